"""HTTP serving benchmark: C concurrent streaming clients against a running graphserve
(or one this script launches), N generated tokens per request (ignore_eos).

Reports total generated tokens/s, requests/s, time to first token p50/p99 and the mean
time per output token, for each concurrency level; writes them with the command line
to benchmarks/results/.

    python benchmarks/serve_bench.py --launch --concurrency 1 8 16 --max-tokens 256
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 8 --num-requests 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # server.testing for --launch, also without an install
RESULTS = REPO / "benchmarks" / "results"
# Continuation-style prompts, so the first token is text (not an end-of-turn token).
BASE_PROMPTS = [
    "Once upon a time, in a lighthouse at the edge of the sea, there lived",
    "A refrigerator keeps food cold by",
    "The best way to learn a new language as an adult is",
    "The water cycle begins when",
]


@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    completion_tokens: int
    chunks: int


@dataclass
class LevelResult:
    concurrency: int
    num_requests: int
    max_tokens: int
    wall_s: float
    total_tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_max_s: float
    tpot_mean_s: float
    per_request_tokens_per_s: float
    chunks_per_request: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def one_request(http: httpx.AsyncClient, prompt: str, args: argparse.Namespace) -> RequestResult:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    tokens = chunks = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"]:
                chunks += 1
                if first is None and event["choices"][0]["text"]:
                    first = time.perf_counter()
    end = time.perf_counter()
    return RequestResult(ttft_s=(first or end) - start, latency_s=end - start, completion_tokens=tokens, chunks=chunks)


async def run_level(url: str, concurrency: int, num_requests: int, args: argparse.Namespace) -> LevelResult:
    prompts = [f"Story {i}. {BASE_PROMPTS[i % len(BASE_PROMPTS)]}" for i in range(num_requests)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(3600.0), limits=limits, headers=_auth(args)
    ) as http:

        async def client() -> None:
            while not queue.empty():
                results.append(await one_request(http, queue.get_nowait(), args))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - start

    total_tokens = sum(r.completion_tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    tpots = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1) for r in results if r.completion_tokens > 1]
    return LevelResult(
        concurrency=concurrency,
        num_requests=num_requests,
        max_tokens=args.max_tokens,
        wall_s=round(wall, 3),
        total_tokens=total_tokens,
        tokens_per_s=round(total_tokens / wall, 2),
        requests_per_s=round(num_requests / wall, 4),
        ttft_p50_s=round(percentile(ttfts, 0.5), 4),
        ttft_p99_s=round(percentile(ttfts, 0.99), 4),
        ttft_max_s=round(max(ttfts), 4),
        tpot_mean_s=round(statistics.fmean(tpots), 5) if tpots else float("nan"),
        per_request_tokens_per_s=round(statistics.fmean(r.completion_tokens / r.latency_s for r in results), 2),
        chunks_per_request=round(statistics.fmean(r.chunks for r in results), 1),
    )


def _auth(args: argparse.Namespace) -> dict[str, str]:
    key = args.api_key or os.environ.get("GRAPHSERVE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", default="http://127.0.0.1:8000", help="a running server")
    target.add_argument("--launch", action="store_true", help="start `python -m server serve` on a free port")
    parser.add_argument("--server-args", default="", help="extra `serve` flags with --launch, e.g. '--max-num-seqs 16'")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8], help="one or more levels, run in order")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per level (default: = concurrency)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model", default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--output", type=Path, default=None, help="JSON file (default: benchmarks/results/serve_bench-<time>.json)"
    )
    args = parser.parse_args()

    server = None
    url = args.url
    if args.launch:
        from server.testing import ServerProcess

        server = ServerProcess(shlex.split(args.server_args))
        print("launched the server on", server.url, flush=True)
        server.wait_ready(600)
        url = server.url
    try:
        models = httpx.get(url + "/v1/models", headers=_auth(args), timeout=10).json()["data"]
        asyncio.run(run_level(url, 1, 1, argparse.Namespace(**{**vars(args), "max_tokens": 4})))  # warm-up
        levels = []
        for concurrency in args.concurrency:
            result = asyncio.run(run_level(url, concurrency, args.num_requests or concurrency, args))
            levels.append(result)
            print(
                f"concurrency {result.concurrency:3d}: {result.num_requests} requests x {result.max_tokens} tokens "
                f"in {result.wall_s:.1f}s -> {result.tokens_per_s:.1f} tok/s, {result.requests_per_s:.3f} req/s, "
                f"TTFT p50 {result.ttft_p50_s:.2f}s p99 {result.ttft_p99_s:.2f}s, "
                f"TPOT {result.tpot_mean_s * 1000:.1f}ms, {result.chunks_per_request:.0f} events/request",
                flush=True,
            )
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)

    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "url": url,
        "model": models[0],
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [asdict(level) for level in levels],
    }
    output = args.output or RESULTS / f"serve_bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
