"""A long context on a sliding-window model (issue 61): the KV blocks a sequence holds once prefilled, and
its decode speed, at each context length, batch 1, random weights (benchmarks/random_models.py configs).

    python benchmarks/window_kv.py --model gpt-oss-20b --contexts 1024 32768 --out window_kv.json

Blocks in use are read from each KV cache group's pool after the step that follows the prefill (the
schedule drops what no later query reads: docs/architecture.md, KV cache groups; gpt-oss has two groups,
the full layers' and the windowed layers'); decode time as
benchmarks/decode_latency.py measures it, T(prompt + 1 + N tokens) - T(prompt + 1 token)."""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from decode_latency import time_engine


def blocks_held(llm, prompt: list[int]) -> list[int]:
    """Per KV cache group, the blocks in use while `prompt`'s sequence decodes: after its prefill and one step more."""
    from graphserve import SamplingParams

    engine = llm.engine
    engine.add_request("held", prompt, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    outputs = 0
    while outputs < 2:  # the prefill's token, then a step whose schedule dropped what the prompt no longer reads
        outputs += sum(len(out.token_ids) > 0 for out in engine.step())
    held = [pool.num_used_blocks for pool in engine.block_manager.pools]
    while engine.has_unfinished():
        engine.step()
    return held


def main() -> None:
    from random_models import CONFIGS, random_model_config

    from graphserve import LLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt-oss-20b", help=f"one of {', '.join(sorted(CONFIGS))}, or a model folder")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    path = str(random_model_config(args.model)) if args.model in CONFIGS else args.model
    cuda = args.device != "cpu"
    rows = []
    for context in args.contexts:
        started = time.perf_counter()
        llm = LLM(path, device=args.device, dtype="bfloat16" if cuda else "float32",
                  load_format="dummy" if args.model in CONFIGS else "safetensors", max_num_seqs=8, decode_chunk=8,
                  max_model_len=context + args.new_tokens + 64, max_num_batched_tokens=8192,
                  gpu_memory_utilization=args.gpu_memory_utilization, prefix_caching=False)
        pool = llm.engine.block_manager
        gen = torch.Generator().manual_seed(context)
        vocab = min(30000, llm.engine.core.worker.model.args.vocab_size)
        prompt = torch.randint(100, vocab, (context,), generator=gen).tolist()
        held = blocks_held(llm, prompt)
        timing = time_engine(llm, lambda: torch.randint(100, vocab, (1, context), generator=gen).tolist(),
                             args.new_tokens)
        rows.append(dict(model=args.model, context=context, block_size=pool.block_size,
                         layer_windows=list(llm.engine.core.worker.model.args.layer_windows),
                         group_windows=[p.window for p in pool.pools], group_pool_blocks=[p.num_blocks for p in pool.pools],
                         blocks_in_use_per_group=held, blocks_in_use=sum(held),
                         blocks_of_context=-(-(context + 1) // pool.block_size),
                         ms_per_step=timing.step_s * 1e3, tokens_per_s=1 / timing.step_s,
                         engine_start_s=time.perf_counter() - started))
        print(json.dumps(rows[-1]), flush=True)
        del llm, pool
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["speed_vs_first_context"] = row["tokens_per_s"] / base
    with open(args.out, "w") as f:
        json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
