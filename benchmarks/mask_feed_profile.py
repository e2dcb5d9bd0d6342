"""Where a constrained round's time goes on the device (issue 12): structured_bench.py's
mixed batch (64 requests, 8 json_schema-constrained) and the same 64 unconstrained, each
run once under torch.profiler. Per kernel: count, total and mean device time; the wait for
the host's masks (kernels/host_wait.py: how long the device sat waiting for the matchers);
device busy time against wall time.

    python benchmarks/mask_feed_profile.py --model qwen2.5-0.5b --config configs/gpu-h200.toml --out $OUT
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from structured_bench import SCHEMA  # noqa: E402
from throughput import engine_config, engine_parser  # noqa: E402
from workload import provenance, resolve_model, write_json  # noqa: E402


def kernel_table(prof) -> dict:
    """Device kernels and copies by name: count, total and mean microseconds."""
    table: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type.name != "CUDA" or evt.device_time <= 0:
            continue
        table.setdefault(evt.name, []).append(evt.device_time)  # microseconds
    rows = {name[:120]: {"count": len(v), "total_us": round(sum(v), 1), "mean_us": round(sum(v) / len(v), 2),
                         "max_us": round(max(v), 1)} for name, v in table.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["total_us"]))


def run(llm, prompts, params, profile: bool) -> dict:
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    if not profile:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        return {"wall_s": time.perf_counter() - started, "tokens": sum(len(o.token_ids) for o in outs)}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
    wall = time.perf_counter() - started
    kernels = kernel_table(prof)
    busy_us = sum(k["total_us"] for k in kernels.values())
    waits = [e.device_time for e in prof.events() if e.device_type.name == "CUDA" and "_wait_kernel" in e.name]
    return {
        "wall_s": wall, "tokens": sum(len(o.token_ids) for o in outs), "device_busy_s": busy_us / 1e6,
        "host_wait_us": {"count": len(waits), "total": round(sum(waits), 1),
                         "p50": round(statistics.median(waits), 2) if waits else None,
                         "max": round(max(waits), 1) if waits else None},
        "kernels_top": dict(list(kernels.items())[:25]),
    }


def main() -> int:
    parser = engine_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--constrained", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    import torch

    from graphserve import LLM, SamplingParams
    from graphserve.engine.structured.grammar import GrammarSpec

    model = resolve_model(args.model)
    config_path, config = engine_config(args, model)
    llm = LLM(**dataclasses.asdict(config))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, 20000, (32,), generator=gen).tolist() for _ in range(args.requests)]
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    every = max(1, args.requests // max(1, args.constrained))
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    mixed = [SamplingParams(max_tokens=384, temperature=0, grammar=grammar) if i % every == 0
             and i // every < args.constrained else free for i in range(args.requests)]
    report = {"provenance": provenance("mask_feed_profile"), "engine": dataclasses.asdict(config), "config_file": str(config_path)}
    for _ in range(2):  # warm-up: grammar compiled and cached, graphs and kernels warm
        run(llm, prompts, mixed, profile=False)
        run(llm, prompts, [free] * args.requests, profile=False)
    report["plain"] = {"unconstrained": run(llm, prompts, [free] * args.requests, profile=False),
                       "mixed": run(llm, prompts, mixed, profile=False)}
    report["profiled"] = {"unconstrained": run(llm, prompts, [free] * args.requests, profile=True),
                          "mixed": run(llm, prompts, mixed, profile=True)}
    for part in ("plain", "profiled"):
        u, m = report[part]["unconstrained"], report[part]["mixed"]
        print(f"{part}: unconstrained {u['tokens'] / u['wall_s']:,.0f} tok/s, mixed {m['tokens'] / m['wall_s']:,.0f} "
              f"tok/s, ratio {(m['tokens'] / m['wall_s']) / (u['tokens'] / u['wall_s']):.3f}")
    for tag in ("unconstrained", "mixed"):
        p = report["profiled"][tag]
        print(f"{tag}: wall {p['wall_s'] * 1e3:.1f} ms, device busy {p['device_busy_s'] * 1e3:.1f} ms, "
              f"host waits {p['host_wait_us']}")
        for name, k in list(p["kernels_top"].items())[:12]:
            print(f"   {k['total_us'] / 1e3:8.2f} ms  {k['count']:6d} x {k['mean_us']:8.2f} us  {name[:90]}")
    path = Path(args.out) / (args.name or f"mask-feed-profile-{Path(model or 'default').name}.json")
    write_json(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
