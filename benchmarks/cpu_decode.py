"""CPU decode throughput: our engine vs transformers `generate` on the embedded model,
same dtype and threads, in one run.

    python benchmarks/cpu_decode.py [--dtype float32] [--new-tokens 256]

Batch 1: decode tokens/s (prompt ~16 tokens, ignore_eos; prefill time subtracted).
Batch 8: total generated tokens/s of 8 concurrent prompts (prefill included).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short story about a robot who learns to paint. It begins:"


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    n = args.new_tokens

    import transformers

    from graphserve import LLM, SamplingParams

    llm = LLM(device="cpu", dtype=args.dtype, num_threads=args.threads)
    prompt_ids = llm.tokenizer.encode(PROMPT)
    greedy = lambda k: SamplingParams(max_tokens=k, temperature=0, ignore_eos=True)  # noqa: E731
    llm.generate([prompt_ids], greedy(8))  # warm-up
    ours_prefill = timed(lambda: llm.generate([prompt_ids], greedy(1)))
    ours_full = timed(lambda: llm.generate([prompt_ids], greedy(n + 1)))
    ours_b1 = n / (ours_full - ours_prefill)
    ours_b8 = 8 * n / timed(lambda: llm.generate([prompt_ids] * 8, greedy(n)))

    hf = transformers.AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=dtype).eval()
    ids = torch.tensor([prompt_ids])

    def hf_generate(k, batch=1):
        x = ids.repeat(batch, 1)
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                        pad_token_id=0)

    hf_generate(8)
    hf_prefill = timed(lambda: hf_generate(1))
    hf_full = timed(lambda: hf_generate(n + 1))
    hf_b1 = n / (hf_full - hf_prefill)
    hf_b8 = 8 * n / timed(lambda: hf_generate(n, batch=8))

    result = dict(
        benchmark="cpu_decode", date=datetime.datetime.now().isoformat(timespec="seconds"),
        command=" ".join(sys.argv), machine=platform.processor() or platform.machine(), threads=args.threads,
        torch=torch.__version__, transformers=transformers.__version__, dtype=args.dtype,
        prompt_tokens=len(prompt_ids), new_tokens=n,
        engine_batch1_tok_s=ours_b1, engine_batch8_tok_s=ours_b8,
        transformers_batch1_tok_s=hf_b1, transformers_batch8_tok_s=hf_b8,
        batch1_speedup_vs_transformers=ours_b1 / hf_b1, batch8_over_batch1=ours_b8 / ours_b1,
    )
    print(f"{'':14s}{'batch 1 tok/s':>15s}{'batch 8 tok/s':>15s}")
    print(f"{'graphserve':14s}{ours_b1:15.1f}{ours_b8:15.1f}")
    print(f"{'transformers':14s}{hf_b1:15.1f}{hf_b8:15.1f}")
    print(f"batch 1 vs transformers: {ours_b1 / hf_b1:.2f}x; our batch 8 / batch 1: {ours_b8 / ours_b1:.2f}x")
    out = Path(args.out or ROOT / f"benchmarks/results/cpu_decode-{args.dtype}-{datetime.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
