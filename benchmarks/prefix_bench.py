"""Prefix caching, shared system prompt (issue 10): N requests sharing a long prefix with
distinct suffixes, through the production server, with and without --no-prefix-caching.
Reports TTFT p50/p99, output tok/s, cached tokens per request and the server's hit rate.

    python benchmarks/prefix_bench.py --model qwen2.5-0.5b --out $OUT
    python benchmarks/prefix_bench.py --model default --device cpu --prefix 1500 --requests 8 --concurrency 2
"""

from __future__ import annotations

import argparse
import array
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import _one_request, scrape  # noqa: E402
from workload import provenance, resolve_model, vocabulary, write_json  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (
        values[0] if values else None)


async def drive(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    records = [dict() for _ in prompts]
    pending = list(range(len(prompts)))
    itl = array.array("d")

    async def stream(http: httpx.AsyncClient) -> None:
        while pending:
            i = pending.pop(0)
            body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            await _one_request(http, body, records[i], itl)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(stream(http) for _ in range(concurrency)))
        return records, time.perf_counter() - started


def run(args, model: str | None, caching: bool, prompts: list[list[int]], extra: list[str]) -> dict:
    from server.testing import ServerProcess

    serve = ["--config", args.config, *(["--model", model] if model else []), *extra,
             *([] if caching else ["--no-prefix-caching"])]
    with ServerProcess(serve) as server:
        server.wait_ready(300)
        warm = [[7, 8, 9, 10]] * 2
        asyncio.run(drive(server.url, warm, 4, 2))
        before = scrape(server.url, {})
        records, wall = asyncio.run(drive(server.url, prompts, args.max_tokens, args.concurrency))
        after = scrape(server.url, {})
        server.terminate()
        server.wait(60)
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    queries = after.get("graphserve_prefix_cache_queries", 0) - before.get("graphserve_prefix_cache_queries", 0)
    hits = after.get("graphserve_prefix_cache_hits", 0) - before.get("graphserve_prefix_cache_hits", 0)
    return dict(prefix_caching=caching, server_args=serve, requests=len(prompts), completed=len(ok),
                errors=sorted({r["error"] for r in records if r["error"]})[:3], wall_s=wall,
                output_tok_s=sum(r["tokens"] for r in ok) / wall, ttft_p50_s=percentile(ttft, 50),
                ttft_p99_s=percentile(ttft, 99), hit_rate=hits / queries if queries else None,
                prefix_cache_queries=queries, prefix_cache_hits=hits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--config", default="gpu-h200")
    parser.add_argument("--prefix", type=int, default=2000, help="shared prefix tokens")
    parser.add_argument("--suffix", type=int, default=32, help="distinct tokens per request")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
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
                  suffix_tokens=args.suffix, max_tokens=args.max_tokens, concurrency=args.concurrency, runs=[])
    for caching in (False, True):
        row = run(args, model, caching, prompts, extra)
        report["runs"].append(row)
        print(f"prefix caching {'on ' if caching else 'off'}: {row['completed']}/{row['requests']} ok, "
              f"{row['output_tok_s']:,.0f} out tok/s, TTFT p50/p99 {row['ttft_p50_s'] * 1e3:.0f} / "
              f"{row['ttft_p99_s'] * 1e3:.0f} ms, hit rate {row['hit_rate']}", flush=True)
    off, on = report["runs"]
    report["ttft_p50_speedup"] = off["ttft_p50_s"] / on["ttft_p50_s"] if on["ttft_p50_s"] else None
    print(f"TTFT p50 with caching: {report['ttft_p50_speedup']:.1f}x lower", flush=True)
    name = args.name or f"prefix_bench-{Path(str(model)).name if model else 'default'}"
    write_json(Path(args.out) / f"{name}.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
