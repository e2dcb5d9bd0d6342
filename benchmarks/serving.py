"""HTTP serving benchmark: the production command (`python -m graphserve serve --config
configs/gpu-h200.toml --model PATH`, launched here on a free loopback port, or a running
server with --url) driven by streaming clients spread over several processes.

    python benchmarks/serving.py --model qwen2.5-0.5b --out $OUT --doubling-check
    python benchmarks/serving.py --model llama-3.1-8b --out $OUT -- --api-server-count 4
    python benchmarks/serving.py --model default --config default --device cpu --concurrency 1 4 \
        --num-requests 8 --min-len 8 --max-len 8 --client-procs 2 --out /tmp/s

Arguments this script does not know (and everything after `--`) are passed to
`server serve` as they are (e.g. --device cpu, --api-server-count 4).

Workload: the shared request set (benchmarks/workload.py: prompt and output lengths
uniform in [--min-len, --max-len], token-id prompts, fixed seed), `POST /v1/completions`
with stream, stream_options.include_usage, ignore_eos and max_tokens = the request's
output length, temperature 0. Level L uses the set's first
min(--num-requests, max(--requests-per-stream x concurrency, --min-requests)) requests.

Levels: closed loop at each --concurrency C (C streams, each sending its next request when
the previous one ends; the C streams are spread over min(P, C) client processes, P =
--client-procs), then (--doubling-check) the highest C again with 2P processes, then
(--poisson-fraction > 0) an open-loop run with Poisson arrivals at that fraction of the
highest request rate measured in the closed-loop levels.

Figures per level:
- output tok/s: sum of usage.completion_tokens / wall time (first request sent to last
  response ended, over all client processes);
- TTFT: request sent -> the first SSE event whose text is not empty;
- TPOT per request: (time of its last content event - time of its first) / (tokens - 1);
- ITL: as vLLM's benchmark_serving defines it, the time between consecutive content
  events of a request (an event may carry several tokens: the server sends one per
  decode round), pooled over all requests;
- client CPU: each client process's CPU time (user + system) over the level / the level's
  wall time; near 1.0 means the client may be the limit (compare with --doubling-check);
- GPU idle ratio: deltas of the server's graphserve_device_idle_seconds_total and
  graphserve_device_busy_seconds_total over the level, idle / (idle + busy); null when
  the server does not export them.
Writes serving-MODEL.json (+ serving-MODEL.png with matplotlib) to --out."""

from __future__ import annotations

import argparse
import array
import asyncio
import json
import multiprocessing as mp
import os
import random
import re
import resource
import shlex
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
for _p in (str(ROOT), str(BENCH), str(ROOT / "tests")):  # tests/: live_server
    if _p not in sys.path:
        sys.path.insert(0, _p)
from sse_client import EventStream  # noqa: E402
from workload import TTFT_METRICS, ttft_means  # noqa: E402

METRIC_IDLE = "graphserve_device_idle_seconds"
METRIC_BUSY = "graphserve_device_busy_seconds"
SERVER_COUNTERS = (METRIC_IDLE, METRIC_BUSY, "graphserve_decode_rounds", "graphserve_decode_rounds_ahead",
                   "graphserve_prefill_steps", "graphserve_num_preemptions", "graphserve_generation_tokens",
                   "graphserve_prompt_tokens", "graphserve_cuda_graph_replays", "graphserve_eager_decode_rounds",
                   "graphserve_prefix_cache_queries", "graphserve_prefix_cache_hits", *TTFT_METRICS)


# ---- one client process --------------------------------------------------------------------------------------

async def _one_request(http: httpx.AsyncClient, body: dict, rec: dict, itl: array.array) -> None:
    """Stream one completion; fill `rec` (ttft, tpot, latency, tokens, events, error) and
    append its inter-event gaps to `itl`."""
    perf = time.perf_counter
    start = perf()
    first = last = None
    tokens = events = 0
    stream = EventStream(http, "/v1/completions", body)
    async for now, payload in stream.events():
        choices = payload.get("choices")
        if choices and choices[0].get("text"):
            events += 1
            if first is None:
                first = now
            else:
                itl.append(now - last)
            last = now
        usage = payload.get("usage")
        if usage:
            tokens = usage.get("completion_tokens", 0)
    end = perf()
    rec.update(ttft=(first - start) if first is not None else None, latency=end - start, tokens=tokens,
               events=events, error=stream.error,
               tpot=(last - first) / (tokens - 1) if first is not None and tokens > 1 else None)


async def _client_async(job: dict, conn) -> None:
    # keepalive_expiry under llama-server's 5 s keep-alive (cpp-httplib): a connection opened before a
    # slow start would otherwise be closed by the server just as the first request goes out on it
    # --fresh-connections: a connection per request, for servers that close each streamed response's
    # connection despite their keep-alive header (llama-server), so that no request goes out on one
    # the server is closing
    keepalive = 0 if job["fresh_connections"] else max(job["streams"], 1) + 4
    limits = httpx.Limits(max_connections=None if job["poisson"] else job["streams"] + 4,
                          max_keepalive_connections=keepalive, keepalive_expiry=4.0)
    headers = {"Authorization": f"Bearer {job['api_key']}"} if job.get("api_key") else {}
    timeout = httpx.Timeout(job["timeout"], connect=60.0)
    async with httpx.AsyncClient(base_url=job["url"], limits=limits, timeout=timeout, headers=headers) as http:
        # open the keep-alive connections before the clock starts
        opened = 0 if job["fresh_connections"] else min(job["streams"], len(job["requests"]))
        await asyncio.gather(*(http.get("/health") for _ in range(opened)), return_exceptions=True)
        conn.send("ready")
        t0, deadline = conn.recv()  # time.monotonic() values: the same clock in every process
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        started = time.monotonic()
        records: list[dict] = []
        itl = array.array("d")

        def body(req: tuple[list[int], int]) -> dict:
            return {"model": req[2], "prompt": req[0], "max_tokens": req[1], "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        async def stream_loop(queue: list) -> None:  # closed loop: the next request when one ends
            while queue:
                req = queue.pop()
                rec = {"max_tokens": req[1]}
                records.append(rec)
                await _one_request(http, body(req), rec, itl)

        async def arrival(offset: float, req) -> None:  # open loop: sent at its arrival time
            await asyncio.sleep(max(0.0, started + offset - time.monotonic()))
            rec = {"max_tokens": req[1]}
            records.append(rec)
            await _one_request(http, body(req), rec, itl)

        if job["poisson"]:
            tasks = [arrival(offset, req) for offset, req in zip(job["arrivals"], job["requests"])]
        else:
            queue = list(reversed(job["requests"]))
            tasks = [stream_loop(queue) for _ in range(job["streams"])]
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=max(1.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            timed_out = True
        ended = time.monotonic()
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    done = [r for r in records if "latency" in r]
    conn.send(dict(records=done, unfinished=len(job["requests"]) - len(done), itl=itl, started=started, ended=ended,
                   cpu_s=cpu, timed_out=timed_out))


def client_process(job: dict, conn, run=None) -> None:
    """Entry of a client process: one asyncio loop (uvloop where installed) running `run(job, conn)`
    (default: this benchmark's closed-loop or Poisson client; spec_serving.py passes its own)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run((run or _client_async)(job, conn))
    except Exception as e:
        conn.send({"fatal": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


# ---- one level: spread over client processes -----------------------------------------------------------------

def percentile(values, q: float) -> float | None:
    if not len(values):
        return None
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q))


def scrape(url: str, headers: dict, names: tuple[str, ...] = SERVER_COUNTERS) -> dict[str, float] | None:
    """The server's counters of interest (`names`): name (without _total) -> the sum over its labels."""
    try:
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    except Exception:
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name = m.group(1).removesuffix("_total")
        if name in names:
            try:
                out[name] = out.get(name, 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


class Interrupted(Exception):
    """SIGTERM or SIGINT: stop the levels, stop the server, write what was measured."""


def _interrupt(signum, frame) -> None:
    raise Interrupted(f"signal {signum}")


SERVER_PROCESSES: dict[str, int] = {}  # "core", "api0", ... -> pid, from the server's log (when launched here)


def server_processes(log: str) -> dict[str, int]:
    """The supervisor's log line "engine core pid N, M front end(s) [a, b]"."""
    match = re.search(r"engine core pid (\d+), \d+ front end\(s\) \[([\d, ]*)\]", log)
    if not match:
        return {}
    fronts = [int(p) for p in match.group(2).split(",") if p.strip()]
    return {"core": int(match.group(1)), **{f"api{i}": pid for i, pid in enumerate(fronts)}}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user + system CPU seconds of each process so far (Linux /proc)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return seconds


def run_level(args, url: str, model_name: str, requests: list, concurrency: int | None, procs: int,
              poisson_rate: float | None = None, timeout: float | None = None) -> dict:
    """Closed loop at `concurrency` (or Poisson arrivals at `poisson_rate` req/s) over `procs`
    client processes; the level's figures."""
    ctx = mp.get_context("spawn")
    active = procs if poisson_rate else max(1, min(procs, concurrency))
    names = args.request_models or [model_name]
    plain = [(r.prompt, r.max_tokens, names[i % len(names)]) for i, r in enumerate(requests)]
    arrivals = None
    if poisson_rate:
        rng = random.Random(args.seed + 7)
        t, arrivals = 0.0, []
        for _ in plain:
            t += rng.expovariate(poisson_rate)
            arrivals.append(t)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    deadline_s = timeout or args.level_timeout
    jobs = []
    for w in range(active):
        streams = 0 if poisson_rate else concurrency // active + (1 if w < concurrency % active else 0)
        jobs.append(dict(url=url, api_key=args.api_key, poisson=bool(poisson_rate),
                         streams=streams if not poisson_rate else 64, requests=plain[w::active],
                         arrivals=arrivals[w::active] if arrivals else None, timeout=deadline_s + 30,
                         fresh_connections=args.fresh_connections))
    before = scrape(url, headers)
    cpu_before, wall_before = cpu_seconds(SERVER_PROCESSES), time.monotonic()
    pipes, workers = [], []
    for job in jobs:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=client_process, args=(job, child), daemon=True)
        proc.start()
        child.close()
        pipes.append(parent)
        workers.append(proc)
    results = []
    try:
        for pipe in pipes:  # every process has imported and opened its connections
            if not pipe.poll(120):
                raise RuntimeError("a client process did not start within 120 s")
            msg = pipe.recv()
            if msg != "ready":
                raise RuntimeError(f"client process: {msg}")
        t0 = time.monotonic() + 0.1
        for pipe in pipes:
            pipe.send((t0, t0 + deadline_s))
        for pipe in pipes:
            if not pipe.poll(deadline_s + 60):
                raise RuntimeError("a client process did not report within the level timeout")
            msg = pipe.recv()
            if "fatal" in msg:
                raise RuntimeError(f"client process failed: {msg['fatal']}")
            results.append(msg)
    except BaseException:
        for proc in workers:
            proc.kill()
        raise
    finally:
        for proc in workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    after = scrape(url, headers)
    row = summarize(results, before, after, concurrency, active, poisson_rate, len(requests))
    cpu_after, wall = cpu_seconds(SERVER_PROCESSES), time.monotonic() - wall_before
    # each server process's CPU use over the level, as a fraction of one core
    row["server_cpu_fraction"] = {name: round((cpu_after[name] - cpu_before[name]) / wall, 3)
                                  for name in cpu_after if name in cpu_before} or None
    return row


def summarize(results, before, after, concurrency, procs, poisson_rate, num_requests) -> dict:
    records = [r for res in results for r in res["records"]]
    ok = [r for r in records if r["error"] is None]
    itl = array.array("d")
    for res in results:
        itl.extend(res["itl"])
    started = min(res["started"] for res in results)
    ended = max(res["ended"] for res in results)
    wall = ended - started
    out_tokens = sum(r["tokens"] for r in records)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    cpu = [res["cpu_s"] / max(1e-9, res["ended"] - res["started"]) for res in results]
    row = dict(mode="poisson" if poisson_rate else "closed", concurrency=concurrency, client_procs=procs,
               request_rate=poisson_rate, num_requests=num_requests, completed=len(ok),
               errors=len(records) - len(ok), unfinished=sum(res["unfinished"] for res in results),
               short=sum(1 for r in ok if r["tokens"] != r["max_tokens"]),
               timed_out=any(res["timed_out"] for res in results), wall_s=wall,
               output_tokens=out_tokens, output_tok_s=out_tokens / wall if wall > 0 else None,
               requests_per_s=len(ok) / wall if wall > 0 else None,
               ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
               tpot_p50_s=percentile(tpot, 50), tpot_p99_s=percentile(tpot, 99),
               itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
               content_events_per_request=sum(r["events"] for r in ok) / len(ok) if ok else None,
               client_cpu_fraction=[round(c, 3) for c in cpu], client_cpu_fraction_max=max(cpu) if cpu else None,
               error_samples=sorted({r["error"] for r in records if r["error"]})[:3])
    server = None
    if before is not None and after is not None:
        server = {k: after[k] - before.get(k, 0.0) for k in after}
    row["server_counters"] = server
    row.update(ttft_means(server or {}))
    idle = server.get(METRIC_IDLE) if server else None
    busy = server.get(METRIC_BUSY) if server else None
    row["gpu_idle_s"], row["gpu_busy_s"] = idle, busy
    row["gpu_idle_ratio"] = idle / (idle + busy) if idle is not None and busy is not None and idle + busy > 0 else None
    return row


def level_size(args, concurrency: int) -> int:
    return min(args.num_requests, max(args.requests_per_stream * concurrency, args.min_requests))


def fmt(row: dict) -> str:
    ms = lambda v: f"{v * 1e3:8.1f}" if v is not None else "       -"  # noqa: E731
    label = (f"poisson {row['request_rate']:.2f} req/s" if row["mode"] == "poisson"
             else f"C={row['concurrency']:<4d}")
    idle = f"{row['gpu_idle_ratio']:.3f}" if row["gpu_idle_ratio"] is not None else "-"
    return (f"{label:22s} P={row['client_procs']:<2d} {row['completed']:5d} ok {row['errors']} err "
            f"{row['wall_s']:7.1f}s {row['output_tok_s'] or 0:10,.0f} out tok/s  TTFT p50/p99 {ms(row['ttft_p50_s'])}"
            f"{ms(row['ttft_p99_s'])} ms  TPOT p50/p99 {ms(row['tpot_p50_s'])}{ms(row['tpot_p99_s'])} ms  "
            f"ITL p99 {ms(row['itl_p99_s'])} ms  client CPU max {row['client_cpu_fraction_max'] or 0:.2f}  "
            f"GPU idle {idle}" + (f"\n    server CPU (cores): {row['server_cpu_fraction']}"
                                  if row.get("server_cpu_fraction") else "")
            + (f"\n    errors: {row['error_samples']}" if row["error_samples"] else ""))


# ---- main ------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b",
                        help="a random_models config (qwen2.5-0.5b, llama-3.1-8b), 'default' (the embedded model) "
                             "or a model folder; with --url, the model the server runs (for its vocabulary)")
    parser.add_argument("--request-models", nargs="+", default=None, metavar="NAME",
                        help="the requests' model field, in turn (e.g. the LoRA adapters of `-- --lora-modules ...`); "
                             "default: the server's first model")
    parser.add_argument("--url", default=None, help="drive this running server instead of launching one")
    parser.add_argument("--config", default=None,
                        help="server config (default: gpu-h200 when CUDA is there and no --device cpu, else default)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--client-procs", type=int, default=4, help="client processes P")
    parser.add_argument("--fresh-connections", action="store_true",
                        help="open a connection per request (no keep-alive), as a server that closes them needs")
    parser.add_argument("--cold-start", action="store_true",
                        help="no warm-up requests: the first --concurrency level runs right after the server says "
                             "ready, then the same level twice again, each time with other prompt ids of the same "
                             "lengths (so it hits no prefix cached before); the report compares the first with the "
                             "second (cold_start), and the third with the second shows the level-to-level spread")
    parser.add_argument("--doubling-check", action="store_true",
                        help="run the highest concurrency again with 2P client processes")
    parser.add_argument("--poisson-fraction", type=float, default=0.8,
                        help="Poisson arrivals at this fraction of the highest measured request rate (0: skip)")
    parser.add_argument("--num-requests", type=int, default=1000, help="the request set; caps every level")
    parser.add_argument("--poisson-requests", type=int, default=None,
                        help="requests of the Poisson run (default: as many as the highest closed-loop level)")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--level-timeout", type=float, default=300.0, help="seconds per level")
    parser.add_argument("--server-timeout", type=float, default=900.0, help="seconds to wait for the server")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole run: each level's timeout is cut to what is left, and levels "
                             "that would start with under 20 s left are skipped (recorded in the JSON)")
    parser.add_argument("--api-key", default=os.environ.get("GRAPHSERVE_API_KEY"))
    parser.add_argument("--offline-json", default=None,
                        help="throughput.py's JSON: report served / offline output tok/s per level")
    parser.add_argument("--out", default=str(BENCH / "results"), help="folder for the JSON, PNG and server log")
    parser.add_argument("--name", default=None, help="file name stem (default serving-MODEL)")
    args, server_extra = parser.parse_known_args()
    server_extra = [a for a in server_extra if a != "--"]
    if args.client_procs < 1:
        parser.error("--client-procs must be >= 1")

    from workload import describe, make_requests, provenance, resolve_model, same_lengths, vocabulary, write_json

    model = resolve_model(args.model)
    vocab_size, specials = vocabulary(model)
    request_set = make_requests(args.num_requests, args.min_len, args.max_len, vocab_size, specials, args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.name or f"serving-{Path(str(model)).name if model else 'default'}"

    server = None
    server_command = None
    url = args.url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if url is None:
        from live_server import ServerProcess

        config = args.config
        if config is None:
            device = server_extra[server_extra.index("--device") + 1] if "--device" in server_extra[:-1] else None
            import torch

            config = "gpu-h200" if torch.cuda.is_available() and device != "cpu" else "default"
        serve_args = ["--config", config, *(["--model", model] if model else []), *server_extra]
        started = time.perf_counter()
        server = ServerProcess(serve_args)
        server_command = shlex.join(server.process.args)
        print(f"launched: {server_command}", flush=True)
    report: dict = {}
    ready_s = None
    levels: list[dict] = []
    skipped: list[str] = []
    exit_code = 0
    begun = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)

    def budget(label: str) -> float | None:
        """This level's timeout, or None to skip it (the time budget is spent)."""
        if args.time_budget is None:
            return args.level_timeout
        left = args.time_budget - (time.monotonic() - begun) - 15  # stopping the server takes a little
        if left < 20:
            skipped.append(label)
            print(f"skipped {label}: {left + 15:.0f}s of the time budget left", flush=True)
            return None
        return min(args.level_timeout, left)

    try:
        if server is not None:
            server.wait_ready(args.server_timeout)
            ready_s = time.perf_counter() - started
            print(f"server ready in {ready_s:.1f}s at {server.url}", flush=True)
            SERVER_PROCESSES.update(server_processes(server.log))
            url = server.url
        model_name = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        if not args.cold_start:  # warm-up (not measured): a few short requests through the same path
            warm = make_requests(2 * args.client_procs, 16, 32, vocab_size, specials, args.seed + 1)
            run_level(args, url, model_name, warm, min(len(warm), 2 * args.client_procs), args.client_procs)

        concurrencies = sorted(args.concurrency)
        if args.cold_start:
            concurrencies = [concurrencies[0]] * 3
        for i, c in enumerate(concurrencies):
            if (timeout := budget(f"closed C={c}")) is None:
                continue
            requests = request_set
            if args.cold_start and i > 0:  # other prompts of the same lengths: no prefix-cache hit on earlier ones
                requests = same_lengths(request_set, vocab_size, specials, args.seed + i)
            row = run_level(args, url, model_name, requests[:level_size(args, c)], c, args.client_procs,
                            timeout=timeout)
            if args.cold_start:
                row["first_after_ready"] = i == 0
            levels.append(row)
            print(fmt(row), flush=True)
        closed = [r for r in levels if r["requests_per_s"]]
        top = max(args.concurrency)
        if args.doubling_check and (timeout := budget(f"doubling check C={top}")) is not None:
            row = run_level(args, url, model_name, request_set[:level_size(args, top)], top, 2 * args.client_procs,
                            timeout=timeout)
            row["doubling_check"] = True
            levels.append(row)
            print(fmt(row), flush=True)
        if args.poisson_fraction > 0 and closed and (timeout := budget("poisson")) is not None:
            best = max(r["requests_per_s"] for r in closed)
            rate = args.poisson_fraction * best
            count = min(args.num_requests, args.poisson_requests or level_size(args, top))
            row = run_level(args, url, model_name, request_set[:count], None, args.client_procs, poisson_rate=rate,
                            timeout=timeout)
            row["rate_fraction_of_best"] = args.poisson_fraction
            levels.append(row)
            print(fmt(row), flush=True)
    except Exception as e:
        failure = f"{type(e).__name__}: {e}"
        failure = failure if len(failure) < 4000 else failure[:1000] + " ... " + failure[-3000:]  # a server log
        print(f"benchmark failed: {failure}", flush=True)
        report["failure"] = failure
        exit_code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stop the server and write the JSON undisturbed
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if server is not None:
            server.terminate()
            try:
                report["server_exit_code"] = server.wait(60)
            except Exception:
                server.stop()
                report["server_exit_code"] = "killed after 60 s"
            (out_dir / f"{stem}.server.log").write_text(server.log)

    if skipped or any(r["errors"] or r["timed_out"] for r in levels):
        exit_code = 1
    offline = None
    if args.offline_json and Path(args.offline_json).is_file():
        offline = json.loads(Path(args.offline_json).read_text()).get("output_tok_s")
        for row in levels:
            row["fraction_of_offline"] = row["output_tok_s"] / offline if offline and row["output_tok_s"] else None
    doubling = None
    if args.doubling_check:
        top = max(args.concurrency)
        pair = [r for r in levels if r["mode"] == "closed" and r["concurrency"] == top]
        if len(pair) == 2:
            a, b = pair
            doubling = dict(concurrency=top, client_procs=[a["client_procs"], b["client_procs"]],
                            output_tok_s=[a["output_tok_s"], b["output_tok_s"]],
                            ttft_p99_s=[a["ttft_p99_s"], b["ttft_p99_s"]],
                            tpot_p99_s=[a["tpot_p99_s"], b["tpot_p99_s"]],
                            client_cpu_fraction_max=[a["client_cpu_fraction_max"], b["client_cpu_fraction_max"]],
                            ratio_2p_over_p=(b["output_tok_s"] / a["output_tok_s"]
                                             if a["output_tok_s"] and b["output_tok_s"] else None))
            print(f"doubling check at C={top}: P={a['client_procs']} {a['output_tok_s'] or 0:,.0f} tok/s, "
                  f"P={b['client_procs']} {b['output_tok_s'] or 0:,.0f} tok/s "
                  f"(ratio {doubling['ratio_2p_over_p'] or float('nan'):.3f})", flush=True)
    cold_start = None
    if args.cold_start and len(levels) >= 2 and levels[0]["output_tok_s"] and levels[1]["output_tok_s"]:
        first, again = levels[0], levels[1]
        runs = [r for r in levels[:3] if r["output_tok_s"]]
        cold_start = dict(concurrency=first["concurrency"],
                          output_tok_s=[r["output_tok_s"] for r in runs],
                          ttft_p50_s=[r["ttft_p50_s"] for r in runs],
                          ttft_p99_s=[r["ttft_p99_s"] for r in runs],
                          throughput_first_over_again=first["output_tok_s"] / again["output_tok_s"],
                          ttft_p99_first_over_again=first["ttft_p99_s"] / again["ttft_p99_s"])
        if len(runs) == 3:  # the same level twice warm: how much a ratio moves without any cold start
            cold_start.update(throughput_third_over_again=runs[2]["output_tok_s"] / again["output_tok_s"],
                              ttft_p99_third_over_again=runs[2]["ttft_p99_s"] / again["ttft_p99_s"])
        print(f"cold start at C={first['concurrency']}: first level {first['output_tok_s']:,.0f} tok/s, TTFT p99 "
              f"{first['ttft_p99_s'] * 1e3:.0f} ms; again {again['output_tok_s']:,.0f} tok/s, "
              f"{again['ttft_p99_s'] * 1e3:.0f} ms"
              + (f"; third {runs[2]['output_tok_s']:,.0f} tok/s, {runs[2]['ttft_p99_s'] * 1e3:.0f} ms" if len(runs) == 3
                 else ""), flush=True)
    report = dict(**provenance("serving"), model=args.model, model_path=str(model) if model else None,
                  url=url if args.url else None, server_command=server_command, client_procs=args.client_procs,
                  request_models=args.request_models,
                  workload=dict(**describe(request_set), min_len=args.min_len, max_len=args.max_len, seed=args.seed,
                                requests_per_stream=args.requests_per_stream, min_requests=args.min_requests,
                                poisson_requests=args.poisson_requests,
                                temperature=0.0, ignore_eos=True, prompts="token ids"),
                  definitions=dict(ttft="request sent -> first SSE event with non-empty text",
                                   tpot="(last content event - first content event) / (completion_tokens - 1)",
                                   itl="time between consecutive content events of a request (vLLM "
                                       "benchmark_serving); an event may carry several tokens",
                                   client_cpu_fraction="CPU seconds of each client process / level wall time",
                                   gpu_idle_ratio="delta idle / (delta idle + delta busy) of the server's "
                                                  "graphserve_device_{idle,busy}_seconds_total",
                                   server_ttft_mean_s="the server's own mean TTFT (from the request parsed) and "
                                                      "its parts, which add up to it: server_queue_time_mean_s "
                                                      "(to the prefill step that takes it), "
                                                      "server_prefill_time_mean_s, server_first_token_return_mean_s "
                                                      "(from the engine's host back to the front end)"),
                  offline_output_tok_s=offline, doubling_check=doubling, cold_start=cold_start, levels=levels,
                  skipped_levels=skipped, server_ready_s=ready_s,
                  **report)
    write_json(out_dir / f"{stem}.json", report)
    try:
        from plot_serving import plot

        plot(report, out_dir / f"{stem}.png")
    except ImportError as e:
        print(f"no plot ({e})", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
