"""LoRA decode throughput against the base model: the engine without LoRA, then with adapter slots, at
batch 1 with one adapter, batch 64 with 8 adapters mixed and batch 64 with 64 distinct adapters (and the
LoRA engine's own base rows), each as tok/s and as a ratio of the base engine's tok/s at that batch.

    python benchmarks/lora.py --out benchmarks/results/lora-h100.json              # GPU: Llama-3.1-8B shape
    python benchmarks/lora.py --scenarios 1x1 8x8 --new-tokens 16                  # CPU: the embedded model
    python benchmarks/lora.py --served --model qwen2.5-0.5b --out $OUT/lora-served.json  # through the server

On CUDA the model is random weights at Llama-3.1-8B's shape (load_format dummy), rank 16 on all seven
projections (--rank, --targets). The adapters are random PEFT folders written here; with more distinct
adapters than --files, files are shared by several adapter names, each its own load (id, slot and
memory), which is what the kernels see. Decode time per step is T(prompt + 1 + N) - T(prompt + 1) over N,
fresh prompts every run (no prefix-cache hits).

--served: through the server instead (benchmarks/serving.py, closed loop): --streams streams over --adapters
adapters (the requests' model field in turn) against the same load on a server without adapters, --rounds
times in turn; output tok/s and TTFT p50 of each, and the ratios of their medians."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from workload import provenance, resolve_model, write_json  # noqa: E402

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, model_path: str, rank: int, modules: tuple[str, ...], seed: int) -> Path:
    """A random PEFT LoRA folder for the model at `model_path` (A ~ N(0, 1/in), B small: outputs stay sane)."""
    from safetensors.torch import save_file

    from graphserve.engine.models.config import ModelArgs
    from graphserve.engine.models.lora_layout import lora_layout

    if (folder / "adapter_model.safetensors").is_file():
        return folder
    layout = lora_layout(ModelArgs.from_dir(model_path))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layout.num_layers):
        for module in modules:
            n_in, n_out = layout.module_shape(module)
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen) / n_in**0.5).bfloat16()
            tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen) * 0.01).bfloat16()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "bias": "none"}))
    return folder


def time_decode(llm, prompts, loras, new_tokens: int, repeats: int) -> float:
    """Seconds per decode step of the batch `prompts()` (fresh each run), rows with `loras`."""
    from graphserve import SamplingParams

    def run(n: int) -> float:
        batch = prompts()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(batch, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), lora_request=loras)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run(9)  # warm-up: the adapters read into the host cache and the slots, kernels compiled
    prefill = min(run(1) for _ in range(repeats))
    full = min(run(new_tokens + 1) for _ in range(repeats))
    return (full - prefill) / new_tokens


def served(args, model_path: str) -> dict:
    """--served: `graphserve serve --lora-modules` with args.adapters adapters against a plain server, the
    same load (serving_level.Load), each round both in turn."""
    from serving_level import Load, alternating_rounds, serving_level

    load = Load(args.model, args.streams, args.served_requests, args.min_len, args.max_len, args.client_procs)
    cuda = torch.cuda.is_available()
    config = "gpu-h200" if cuda else "default"
    engine = ["--max-num-seqs", str(max(args.streams, 8))] + ([] if cuda else ["--device", "cpu"])
    folders = [write_adapter(Path(args.adapters_dir) / f"{Path(model_path).name}-r{args.rank}-{i}", model_path,
                             args.rank, tuple(args.targets), seed=i) for i in range(min(args.files, args.adapters))]
    names = [f"adapter-{i}" for i in range(args.adapters)]
    lora = ["--lora-modules", *(f"{n}={folders[i % len(folders)]}" for i, n in enumerate(names)),
            "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
    compared = alternating_rounds(
        "adapters", lambda i: serving_level(load, f"lora-served-adapters-{i}", args.run_timeout, config=config,
                                            server_args=engine + lora, request_models=names),
        "base", lambda i: serving_level(load, f"lora-served-base-{i}", args.run_timeout, config=config,
                                        server_args=engine), args.rounds)
    ratio = compared["tok_s_ratio"]
    print(f"{args.adapters} adapters x {args.streams // args.adapters} streams: {ratio:.3f}x the base model's "
          "output tok/s through the server", flush=True)
    return dict(load=vars(load), config=config, engine_flags=engine, lora_flags=lora[-4:], **compared,
                target={"tok/s >= 0.8x base": ratio >= 0.8})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    parser.add_argument("--model", default="llama-3.1-8b" if cuda else "default",
                        help="a random_models config name (GPU: random weights), default (the embedded model), a folder")
    parser.add_argument("--scenarios", nargs="+", default=["1x1", "64x8", "64x64"] if cuda else ["1x1", "8x8"],
                        help="BATCHxADAPTERS: rows of the batch, distinct adapters among them")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=list(ALL_MODULES))
    parser.add_argument("--files", type=int, default=8, help="distinct adapter files written")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128 if cuda else 16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--adapters-dir", default="/tmp/graphserve-lora-bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--served", action="store_true", help="through the server (benchmarks/serving.py)")
    parser.add_argument("--adapters", type=int, default=8, help="--served: adapters the requests pick in turn")
    parser.add_argument("--streams", type=int, default=64 if cuda else 8, help="--served: closed-loop streams")
    parser.add_argument("--served-requests", type=int, default=256 if cuda else 32)
    parser.add_argument("--min-len", type=int, default=100 if cuda else 32, help="--served: prompt/output tokens")
    parser.add_argument("--max-len", type=int, default=1024 if cuda else 64)
    parser.add_argument("--client-procs", type=int, default=4 if cuda else 2)
    parser.add_argument("--rounds", type=int, default=1 if cuda else 2, help="--served: rounds of (base, adapters)")
    parser.add_argument("--run-timeout", type=float, default=400.0, help="--served: seconds a server run may take")
    args = parser.parse_args()

    from graphserve import LLM, LoraRequest

    if args.served:
        from workload import model_folder

        result = dict(provenance("lora served"), model=args.model, rank=args.rank, targets=args.targets,
                      **served(args, str(model_folder(resolve_model(args.model)))))
        if args.out:
            write_json(args.out, result)
        return
    scenarios = [tuple(int(v) for v in s.split("x")) for s in args.scenarios]
    if cuda:
        from random_models import CONFIGS, random_model_config

        path = str(random_model_config(args.model)) if args.model in CONFIGS else resolve_model(args.model)
        engine = dict(dtype="bfloat16", load_format="dummy" if args.model in CONFIGS else "safetensors")
    else:
        path = resolve_model(args.model)
        engine = {}
    max_batch = max(b for b, _ in scenarios)
    most = max(a for _, a in scenarios)
    engine.update(max_num_seqs=max(max_batch, 8), max_model_len=args.prompt_len + args.new_tokens + 64,
                  max_num_batched_tokens=max(8192, max_batch * (args.prompt_len + 1)))
    gen = torch.Generator().manual_seed(0)

    def prompts(batch):
        return lambda: torch.randint(100, 30000, (batch, args.prompt_len), generator=gen).tolist()

    rows = []

    def record(kind: str, batch: int, adapters: int, step_s: float) -> None:
        rows.append(dict(engine=kind, batch=batch, adapters=adapters, step_ms=step_s * 1e3, tok_s=batch / step_s))
        print(f"{kind:5s} batch {batch:3d} adapters {adapters:3d}: {step_s * 1e3:8.3f} ms/step "
              f"{batch / step_s:10.1f} tok/s", flush=True)

    base = LLM(path, **engine)
    model_path = base.engine.model_path
    for batch in sorted({b for b, _ in scenarios}):
        record("base", batch, 0, time_decode(base, prompts(batch), None, args.new_tokens, args.repeats))
    del base
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    folders = [write_adapter(Path(args.adapters_dir) / f"{Path(model_path).name}-r{args.rank}-{i}", model_path,
                             args.rank, tuple(args.targets), seed=i) for i in range(args.files)]
    loras = [LoraRequest(f"adapter-{i}", i + 1, str(folders[i % len(folders)])) for i in range(most)]
    llm = LLM(path, enable_lora=True, max_loras=max(1, most), max_cpu_loras=max(1, most), max_lora_rank=args.rank,
              **engine)
    for batch in sorted({b for b, _ in scenarios}):
        record("lora", batch, 0, time_decode(llm, prompts(batch), None, args.new_tokens, args.repeats))
    for batch, adapters in scenarios:
        picks = [loras[i % adapters] for i in range(batch)] if adapters else None
        record("lora", batch, adapters, time_decode(llm, prompts(batch), picks, args.new_tokens, args.repeats))
    base_tok_s = {r["batch"]: r["tok_s"] for r in rows if r["engine"] == "base"}
    for row in rows:
        row["vs_base"] = row["tok_s"] / base_tok_s[row["batch"]]
    for row in rows:
        if row["engine"] == "lora":
            print(f"batch {row['batch']:3d} with {row['adapters']:3d} adapters: {row['vs_base']:.3f}x the base "
                  "engine's tok/s")
    result = dict(provenance("lora"), model=args.model, rank=args.rank, targets=args.targets,
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, rows=rows)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
