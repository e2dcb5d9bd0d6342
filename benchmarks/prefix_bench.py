"""Prefix caching, shared system prompt (issue 10): N requests sharing a long prefix with
distinct suffixes, through the production server, with and without --no-prefix-caching.
Reports TTFT p50/p99, output tok/s, cached tokens per request and the server's hit rate.

    python benchmarks/prefix_bench.py --model qwen2.5-0.5b --out $OUT
    python benchmarks/prefix_bench.py --model default --device cpu --prefix 1500 --requests 8 --concurrency 2
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multiturn_bench import fmt_ms, run_chains, run_server  # noqa: E402
from workload import provenance, resolve_model, vocabulary, write_json  # noqa: E402


def run(args, model: str | None, caching: bool, prompts: list[list[int]], extra: list[str]) -> dict:
    """One server (with or without --no-prefix-caching): the prompts in a closed loop at
    --concurrency, over --client-procs client processes (multiturn_bench.run_chains: chains
    of one turn)."""
    chains = [dict(id=i, prompt=p, new=[]) for i, p in enumerate(prompts)]

    def work(url: str):
        return run_chains(url, chains, args.concurrency, args.max_tokens, args.client_procs)

    row, _ = run_server(args, model, caching, extra, work)
    counters = row["server_counters"]
    row.update(hit_rate=row["server_hit_rate"], prefix_cache_queries=counters["graphserve_prefix_cache_queries"],
               prefix_cache_hits=counters["graphserve_prefix_cache_hits"])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--config", default="gpu-h200")
    parser.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=32, help="distinct tokens per request")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-procs", type=int, default=4, help="client processes the streams are spread over")
    parser.add_argument("--caching", choices=["both", "on", "off"], default="both")
    parser.add_argument("--server-timeout", type=float, default=300.0)
    parser.add_argument("--work-timeout", type=float, default=900.0,
                        help="seconds the requests may take; then the server's stacks and log go to --out")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--name", default=None)
    args, extra = parser.parse_known_args()
    model = resolve_model(args.model)
    vocab_size, specials = vocabulary(model)
    rng = random.Random(0)
    allowed = [t for t in range(100, min(vocab_size, 30000)) if t not in specials]
    prefix = [rng.choice(allowed) for _ in range(args.prefix)]
    prompts = [prefix + [rng.choice(allowed) for _ in range(args.suffix)] for _ in range(args.requests)]
    report = dict(**provenance("prefix_bench"), model=args.model, prefix_tokens=args.prefix,
                  suffix_tokens=args.suffix, max_tokens=args.max_tokens, concurrency=args.concurrency,
                  client_procs=args.client_procs, runs=[])
    for caching in {"both": (False, True), "on": (True,), "off": (False,)}[args.caching]:
        row = run(args, model, caching, prompts, extra)
        report["runs"].append(row)
        print(f"prefix caching {'on ' if caching else 'off'}: {row['completed']}/{row['requests']} ok, "
              f"{row['output_tok_s']:,.0f} out tok/s, TTFT p50/p99 {fmt_ms(row['ttft_p50_s'])} / "
              f"{fmt_ms(row['ttft_p99_s'])} ms (mean {fmt_ms(row['ttft_mean_s'])}, server-side mean "
              f"{fmt_ms(row['server_ttft_mean_s'])}: queue {fmt_ms(row['server_queue_time_mean_s'])}, prefill "
              f"{fmt_ms(row['server_prefill_time_mean_s'])}, back {fmt_ms(row['server_first_token_return_mean_s'])}), "
              f"hit rate {row['hit_rate']}", flush=True)
    if len(report["runs"]) == 2:
        off, on = report["runs"]
        report["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"] if on["ttft_p50_s"] else None
        print(f"TTFT p50 with caching: {report['ttft_p50_speedup']:.1f}x lower", flush=True)
    name = args.name or f"prefix_bench-{Path(str(model)).name if model else 'default'}"
    write_json(Path(args.out) / f"{name}.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
