"""Prefix caching, multi-turn chat (issue 10): C conversations x T turns through the
production server, with and without --no-prefix-caching. Every turn resends the whole
history as token ids: the previous turn's prompt ids, the model's own output ids (taken
from the response with `return_token_ids`, so they are exactly what the model produced),
and --new fresh random tokens (the next user message). The conversations run at once, each
on its own stream, each turn sent when the previous one ended.

Reports, per turn and over all turns: TTFT p50/p99, cached prompt tokens (from
usage.prompt_tokens_details.cached_tokens) as a fraction of prompt tokens, and the server's
own hit rate (graphserve_prefix_cache_hits / _queries over the run).

    python benchmarks/multiturn_bench.py --model qwen2.5-0.5b --out $OUT
    python benchmarks/multiturn_bench.py --model default --config default --device cpu \\
        --conversations 4 --turns 3 --first 64 --new 32 --max-tokens 16 --client-procs 1 --out /tmp/m

Arguments this script does not know are passed to `server serve` (e.g. --device cpu).

The client: the conversations are spread over --client-procs processes (one asyncio loop
each), so one Python process parsing every stream is not what is measured (issue 9);
benchmarks/prefix_bench.py drives its requests with the same client (`run_chains`).
TTFT: request sent -> the first SSE event with generated tokens."""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import re
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
for _p in (str(ROOT), str(BENCH), str(ROOT / "tests")):  # tests/: live_server
    if _p not in sys.path:
        sys.path.insert(0, _p)

from sse_client import EventStream  # noqa: E402
from workload import TTFT_METRICS, provenance, resolve_model, vocabulary, ttft_means, write_json  # noqa: E402

METRICS = ("graphserve_prefix_cache_queries", "graphserve_prefix_cache_hits", "graphserve_prompt_tokens",
           "graphserve_generation_tokens", "graphserve_prefill_steps", "graphserve_decode_rounds",
           "graphserve_decode_rounds_ahead", "graphserve_prefill_graph_steps", "graphserve_prefill_steps_ahead",
           "graphserve_core_gc_full_collections", "graphserve_core_gc_full_collection_seconds", *TTFT_METRICS)


def percentile(values: list[float], q: int) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def scrape(url: str) -> dict[str, float]:
    """METRICS from /metrics (counters without _total), summed over their labels."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1).removesuffix("_total") in METRICS:
            name = m.group(1).removesuffix("_total")
            out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def settled_scrape(url: str, previous: dict[str, float] | None = None) -> dict[str, float]:
    """The engine core sends its counters to the front ends at most every 0.1 s: scrape until
    two reads 0.15 s apart agree, so the last requests of a run are counted."""
    last = scrape(url)
    for _ in range(20):
        time.sleep(0.15)
        now = scrape(url)
        if now == last:
            return now
        last = now
    return last


# ---- the client: chains of turns (a conversation; one request is a chain of one) --------------

async def stream_turn(http: httpx.AsyncClient, body: dict) -> dict:
    """One streamed completion with return_token_ids: ttft, latency, token_ids, cached, error."""
    perf = time.perf_counter
    start = perf()
    first = None
    token_ids: list[int] = []
    usage: dict = {}
    stream = EventStream(http, "/v1/completions", body)
    async for now, payload in stream.events():
        for choice in payload.get("choices") or []:
            ids = choice.get("token_ids") or []
            if ids and first is None:
                first = now
            token_ids += ids
        usage = payload.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return dict(ttft=None if first is None else first - start, latency=perf() - start, token_ids=token_ids,
                prompt_tokens=usage.get("prompt_tokens", len(body["prompt"])),
                cached_tokens=details.get("cached_tokens", 0), completion_tokens=usage.get("completion_tokens", 0),
                error=stream.error)


async def _run_chains_async(url: str, chains: list[dict], streams: int, max_tokens: int, t0: float) -> list[dict]:
    """Each of `streams` streams takes the next chain and runs its turns in order: turn 0
    sends chain["prompt"]; turn t > 0 sends the previous prompt + the previous output ids +
    chain["new"][t - 1]."""
    limits = httpx.Limits(max_connections=streams + 4, max_keepalive_connections=streams + 4)
    records: list[dict] = []
    queue = list(reversed(chains))
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0, connect=60.0), limits=limits) as http:
        await asyncio.gather(*(http.get("/health") for _ in range(min(streams, len(chains)))))
        await asyncio.sleep(max(0.0, t0 - time.time()))

        async def stream_loop() -> None:
            while queue:
                chain = queue.pop()
                prompt = list(chain["prompt"])
                for turn in range(1 + len(chain["new"])):
                    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
                    rec = await stream_turn(http, body)
                    rec.update(chain=chain["id"], turn=turn, ended_at=time.time())
                    output = rec.pop("token_ids")
                    rec["output_tokens"] = len(output)
                    records.append(rec)
                    if rec["error"] is not None or turn == len(chain["new"]):
                        break
                    prompt = prompt + output + chain["new"][turn]

        await asyncio.gather(*(stream_loop() for _ in range(streams)))
    return records


def _client_process(url, chains, streams, max_tokens, t0, conn) -> None:
    try:
        conn.send(asyncio.run(_run_chains_async(url, chains, streams, max_tokens, t0)))
    except Exception as e:
        conn.send({"fatal": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def run_chains(url: str, chains: list[dict], concurrency: int, max_tokens: int, procs: int) -> tuple[list[dict], float]:
    """The chains over min(procs, concurrency) client processes (chain i to process i % P),
    `concurrency` streams in all; returns (records, wall seconds from the common start)."""
    procs = max(1, min(procs, concurrency, len(chains)))
    ctx = mp.get_context("spawn")
    t0 = time.time() + 2.0 + 0.5 * procs  # time for the processes to import and connect
    pipes, workers = [], []
    for w in range(procs):
        streams = concurrency // procs + (1 if w < concurrency % procs else 0)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_client_process, args=(url, chains[w::procs], streams, max_tokens, t0, child),
                           daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        workers.append(proc)
    records: list[dict] = []
    try:
        for pipe in pipes:
            result = pipe.recv()
            if isinstance(result, dict):
                raise RuntimeError(f"client process failed: {result['fatal']}")
            records += result
    finally:
        for proc in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    ended = max((r["ended_at"] for r in records), default=t0)
    return records, ended - t0


def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    cached = sum(r["cached_tokens"] for r in ok)
    return dict(requests=len(records), completed=len(ok), errors=sorted({r["error"] for r in records if r["error"]})[:3],
                ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                ttft_mean_s=statistics.fmean(ttft) if ttft else None, prompt_tokens=prompt, cached_tokens=cached,
                usage_hit_rate=cached / prompt if prompt else None,
                output_tokens=sum(r["completion_tokens"] for r in ok))


def run_server(args, model: str | None, caching: bool, extra: list[str], work) -> dict:
    """Start the server (with or without --no-prefix-caching), warm it, run work(url) ->
    (records, wall), and add the server's counters over the run."""
    from live_server import ServerProcess

    serve = ["--config", args.config, *(["--model", model] if model else []), *extra,
             *([] if caching else ["--no-prefix-caching"])]
    with ServerProcess(serve) as server:
        server.wait_ready(args.server_timeout)
        # 16 connections: every front end (4 by default) most likely gets some of the warm-up
        warm = [dict(id=-1, prompt=[7, 8, 9, 10], new=[])] * 16
        run_chains(server.url, warm, 16, 4, 1)
        before = settled_scrape(server.url)
        records, wall = within(args.work_timeout, lambda: work(server.url), server, Path(args.out))
        after = settled_scrape(server.url)
        server.terminate()
        server.wait(60)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}
    queries, hits = delta["graphserve_prefix_cache_queries"], delta["graphserve_prefix_cache_hits"]
    row = dict(prefix_caching=caching, server_args=serve, wall_s=wall, **summarize(records),
               server_hit_rate=hits / queries if queries else None, server_counters=delta, **ttft_means(delta))
    row["output_tok_s"] = row["output_tokens"] / wall if wall else None
    return row, records


def within(seconds: float, work, server, out: Path):
    """work() if it ends within `seconds`; else the server's stacks (SIGUSR1) and its log go to
    out/server-stalled-<time>.log, and TimeoutError."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        server.dump_stacks()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"server-stalled-{time.strftime('%Y%m%d-%H%M%S')}.log"
        path.write_text(server.log)
        raise TimeoutError(f"the requests did not finish within {seconds:.0f} s; the server's log and "
                           f"stacks: {path}")
    if "error" in result:
        raise result["error"]
    return result["value"]


def make_conversations(args, model: str | None) -> list[dict]:
    vocab_size, specials = vocabulary(model)
    rng = random.Random(args.seed)
    allowed = [t for t in range(100, min(vocab_size, 30000)) if t not in specials]
    pick = lambda n: [rng.choice(allowed) for _ in range(n)]  # noqa: E731
    system = pick(args.system)
    return [dict(id=c, prompt=system + pick(args.first), new=[pick(args.new) for _ in range(args.turns - 1)])
            for c in range(args.conversations)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--config", default="gpu-h200")
    parser.add_argument("--conversations", type=int, default=32, help="run at once, one stream each")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system", type=int, default=0, help="tokens of a system prompt shared by every conversation")
    parser.add_argument("--first", type=int, default=100, help="tokens of each conversation's first user message")
    parser.add_argument("--new", type=int, default=100, help="new user tokens in each later turn")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens the model answers per turn")
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--caching", choices=["both", "on", "off"], default="both")
    parser.add_argument("--server-timeout", type=float, default=300.0)
    parser.add_argument("--work-timeout", type=float, default=900.0,
                        help="seconds the requests may take; then the server's stacks and log go to --out")
    parser.add_argument("--out", default=str(BENCH / "results"))
    parser.add_argument("--name", default=None)
    args, extra = parser.parse_known_args()
    model = resolve_model(args.model)
    conversations = make_conversations(args, model)
    report = dict(**provenance("multiturn_bench"), model=args.model,
                  workload=dict(conversations=args.conversations, turns=args.turns, system_tokens=args.system,
                                first_tokens=args.first, new_tokens=args.new, max_tokens=args.max_tokens,
                                client_procs=args.client_procs, seed=args.seed, ignore_eos=True, prompts="token ids"),
                  runs=[])
    settings = {"both": (False, True), "on": (True,), "off": (False,)}[args.caching]
    for caching in settings:
        def work(url: str):
            return run_chains(url, conversations, args.conversations, args.max_tokens, args.client_procs)

        row, records = run_server(args, model, caching, extra, work)
        row["per_turn"] = [dict(turn=t, **summarize([r for r in records if r["turn"] == t]))
                           for t in range(args.turns)]
        later = [r for r in records if r["turn"] > 0]
        row["usage_hit_rate_later_turns"] = summarize(later)["usage_hit_rate"] if later else None
        report["runs"].append(row)
        print(f"prefix caching {'on ' if caching else 'off'}: {row['completed']}/{row['requests']} ok in "
              f"{row['wall_s']:.1f}s, hit rate {row['server_hit_rate']} (server) / {row['usage_hit_rate']:.3f} "
              f"(usage), TTFT p50/p99 {fmt_ms(row['ttft_p50_s'])} / {fmt_ms(row['ttft_p99_s'])} ms", flush=True)
        for t in row["per_turn"]:
            print(f"  turn {t['turn']}: prompt {t['prompt_tokens'] / max(1, t['completed']):.0f} tokens avg, "
                  f"cached {t['usage_hit_rate'] or 0:.1%}, TTFT p50/p99 {fmt_ms(t['ttft_p50_s'])} / "
                  f"{fmt_ms(t['ttft_p99_s'])} ms", flush=True)
    name = args.name or f"multiturn_bench-{Path(str(model)).name if model else 'default'}"
    write_json(Path(args.out) / f"{name}.json", report)
    return 0 if all(r["completed"] == r["requests"] for r in report["runs"]) else 1


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


if __name__ == "__main__":
    sys.exit(main())
