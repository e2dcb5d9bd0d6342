"""graphserve on Ray Serve (issue 57, docs/scaling.md): three measurements, each written as JSON to --out.

    python benchmarks/ray_serving.py routing    # prefix-affinity router vs Ray Serve's default, same workload
    python benchmarks/ray_serving.py kill       # kill -9 of one replica's engine under load
    python benchmarks/ray_serving.py overhead   # 1 replica under Ray vs `graphserve serve` directly
    python benchmarks/ray_serving.py overhead --model qwen2.5-0.5b --config gpu-h200 --streams 64   # a GPU

routing and kill run a local Ray cluster of --nodes nodes with --cpus-per-node CPUs (ray.cluster_utils: the
raylets on this machine, as tests/test_ray_serving.py), one replica of the embedded model per node, one
torch thread each:

- routing: --prompts system prompts of ~--prompt-tokens tokens (random words, fixed seed), --requests chat
  requests over them in a seeded random order, --streams closed-loop streams, --max-tokens each. First each
  system prompt once, in turn (not measured: every prompt then sits in some replica's cache, as in a server
  that has run a while), then the measured requests. Per router: the prefix-cache hit rate (usage's
  cached_tokens / prompt_tokens, summed), TTFT p50 / p90, which replica served each prompt. Each router gets
  fresh replicas. The replicas' KV cache (--kv-cache-bytes) holds about 5.8 of the 8 prompts: the regime
  cache-aware routing is for, where the prompts fit in the replicas' caches together but not in each one.
- kill: --streams streams of short chat requests for --duration seconds; --kill-after seconds in, SIGKILL of
  one replica's engine-core process. Every request's outcome (ok, error: which replica, hung: no answer
  within --request-timeout), and when two replicas are serving again.
- overhead: benchmarks/serving.py (the same request set, concurrency and client processes) against
  `graphserve serve --ray --replicas 1` and then against `graphserve serve`, the same engine flags, --rounds
  times in turn; output tok/s and TTFT p50 of each, and the ratios of their medians.

Take the machine's benchmark lock when others share it:
    [ -e /tmp/freeze.on ] || flock /tmp/graphserve-bench.lock python benchmarks/ray_serving.py routing
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
for _p in (str(BENCH), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from workload import provenance, write_json  # noqa: E402

REPLICA = "x-graphserve-replica"
WORDS = ("river mountain violin comet garden window silver planet thunder harbor lantern meadow crystal falcon "
         "orchard canyon glacier compass beacon willow ember quarry marble saddle anchor tundra prism velvet").split()


# ---- a local Ray cluster and the graphserve app on it ------------------------------------------------------


@contextlib.contextmanager
def ray_cluster(nodes: int, cpus_per_node: int, port: int) -> Iterator[str]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from graphserve.server.ray_app.app import RAY_SERVE_MODE

    os.environ.update(RAY_SERVE_MODE)  # the Ray Serve mode `graphserve serve --ray` runs in; its processes inherit it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def deploy(args, replicas: int, router: str) -> float:
    """A fresh graphserve app (new replicas, cold caches); returns the seconds until Ray said it runs."""
    from ray import serve

    from graphserve.server.ray_app.app import APP_NAME, Scaling, graphserve_application
    from graphserve.server.settings import ServerSettings

    serve.delete(APP_NAME)
    started = time.perf_counter()
    serve.run(graphserve_application(ServerSettings(), engine_config(args), Scaling(replicas=replicas, router=router)),
              name=APP_NAME, route_prefix="/")
    return time.perf_counter() - started


def engine_config(args):
    from graphserve.engine.config import EngineConfig

    return EngineConfig(device="cpu", num_threads=1, max_model_len=args.max_model_len, max_num_seqs=args.streams,
                        kv_cache_bytes=args.kv_cache_bytes, decode_chunk=2)


def replica_statuses() -> list:
    """Each running replica's status (server/ray_app/replica.py), reached in turn."""
    from ray import serve

    from graphserve.server.ray_app.app import APP_NAME, REPLICA_DEPLOYMENT
    from graphserve.server.ray_app.forwarded import ReplicaQuery

    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP_NAME)
    seen: dict = {}
    while True:
        status = handle.replica_status.remote(ReplicaQuery(frozenset(seen))).result(timeout_s=60)
        if status.replica_id in seen:
            return list(seen.values())
        seen[status.replica_id] = status


# ---- the client ------------------------------------------------------------------------------------------


async def chat(http: httpx.AsyncClient, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """One streamed chat request: times, usage, the replica that served it, or what went wrong."""
    record = {"sent": time.perf_counter(), "first": None, "end": None, "replica": None, "prompt_tokens": None,
              "cached_tokens": None, "completion_tokens": 0, "error": None}
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with asyncio.timeout(timeout):
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                record["replica"] = response.headers.get(REPLICA)
                if response.status_code != 200:
                    record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return record
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        record["error"] = f"SSE error: {event['error'].get('code')}"
                    elif event.get("usage"):
                        usage = event["usage"]
                        record.update(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                                      cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                    elif record["first"] is None and any(c["delta"].get("content") for c in event["choices"]):
                        record["first"] = time.perf_counter()
    except TimeoutError:
        record["error"] = "hung"
    except httpx.HTTPError as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[:200]
    record["end"] = time.perf_counter()
    return record


async def closed_loop(url: str, jobs: list[tuple[str, list[dict]]], streams: int, max_tokens: int,
                      timeout: float, stop_at: float | None = None) -> list[dict]:
    """`streams` workers take the next (label, messages) job as their last ends; until the jobs or the time
    (stop_at, on time.perf_counter) run out."""
    queue = list(reversed(jobs))
    records: list[dict] = []

    async def worker(http: httpx.AsyncClient) -> None:
        while queue and (stop_at is None or time.perf_counter() < stop_at):
            label, messages = queue.pop()
            record = await chat(http, messages, max_tokens, timeout)
            record["label"] = label
            records.append(record)

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(streams)))
    return records


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = [r["first"] - r["sent"] for r in ok if r["first"] is not None]
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached = sum(r["cached_tokens"] or 0 for r in ok)
    span = (max(r["end"] for r in records) - min(r["sent"] for r in records)) if records else 0
    return {"requests": len(records), "ok": len(ok), "errors": len(records) - len(ok),
            "hit_rate": cached / prompt if prompt else None, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p90_s": percentile(ttft, 0.9),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "output_tok_s": sum(r["completion_tokens"] for r in ok) / span if span else None, "wall_s": span}


# ---- routing ----------------------------------------------------------------------------------------------


def system_prompts(count: int, tokens: int, seed: int) -> list[str]:
    """Distinct system prompts of about `tokens` tokens each (SmolLM2's tokenizer: ~1.07 tokens a word here)."""
    rng = random.Random(seed)
    words = int(tokens / 1.07)
    return [f"You are assistant number {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(count)]


def routing(args) -> dict:
    prompts = system_prompts(args.prompts, args.prompt_tokens, args.seed)
    rng = random.Random(args.seed + 1)
    order = [i % len(prompts) for i in range(args.requests)]
    rng.shuffle(order)
    jobs = [(f"p{p}", [{"role": "system", "content": prompts[p]}, {"role": "user", "content": f"Question {n}?"}])
            for n, p in enumerate(order)]
    warm_up = [(f"p{p}", [{"role": "system", "content": prompts[p]}, {"role": "user", "content": "Warm up."}])
               for p in range(len(prompts))]
    runs = {}
    with ray_cluster(args.nodes, args.cpus_per_node, args.port) as url:
        for router in args.routers:
            ready_s = deploy(args, args.nodes, router)
            print(f"{router}: {args.nodes} replicas ready in {ready_s:.1f}s", flush=True)
            warm = asyncio.run(closed_loop(url, warm_up, 1, 1, args.request_timeout))
            records = asyncio.run(closed_loop(url, jobs, args.streams, args.max_tokens, args.request_timeout))
            row = summary(records)
            row.update(router=router, warm_up=summary(warm), replicas_ready_s=ready_s,
                       served_by={label: sorted({r["replica"] for r in records if r["label"] == label} - {None})
                                  for label in sorted({r["label"] for r in records})},
                       engine_hit_rate=engine_hit_rate())
            runs[router] = row
            print(json.dumps({k: v for k, v in row.items() if k != "served_by"}), flush=True)
    result = {"runs": runs}
    if {"prefix-affinity", "power-of-two"} <= set(runs):
        ours, theirs = runs["prefix-affinity"], runs["power-of-two"]
        result["ttft_p50_ratio"] = ours["ttft_p50_s"] / theirs["ttft_p50_s"]
        result["targets"] = {"hit_rate >= 0.9": ours["hit_rate"] >= 0.9,
                             "ttft_p50 <= 0.5x default": result["ttft_p50_ratio"] <= 0.5}
    return result


def engine_hit_rate() -> dict:
    """Each replica's prefix cache since it started (its engine's counters, warm-up included)."""
    return {s.replica_id: {"queries": s.stats.prefix_cache_queries, "hits": s.stats.prefix_cache_hits}
            for s in replica_statuses()}


# ---- kill -------------------------------------------------------------------------------------------------


def kill(args) -> dict:
    prompts = system_prompts(args.streams, 64, args.seed)
    jobs = [(f"p{n % len(prompts)}", [{"role": "system", "content": prompts[n % len(prompts)]},
                                      {"role": "user", "content": f"Tell story {n}."}]) for n in range(100_000)]
    with ray_cluster(args.nodes, args.cpus_per_node, args.port) as url:
        deploy(args, args.nodes, "prefix-affinity")
        before = {s.replica_id: s for s in replica_statuses()}
        victim = sorted(before)[0]
        events: dict = {}

        async def scenario() -> list[dict]:
            start = time.perf_counter()
            load = asyncio.create_task(closed_loop(url, jobs, args.streams, args.max_tokens, args.request_timeout,
                                                   stop_at=start + args.duration))
            await asyncio.sleep(args.kill_after)
            os.kill(before[victim].engine_core_pid, signal.SIGKILL)
            events["killed"] = time.perf_counter()
            while time.perf_counter() - events["killed"] < args.recovery_timeout:
                statuses = await asyncio.to_thread(replica_statuses)
                if len(statuses) == len(before) and victim not in {s.replica_id for s in statuses} and all(
                        s.status == "ok" for s in statuses):
                    events["replicas_back"] = time.perf_counter()
                    break
                await asyncio.sleep(0.5)
            return await load

        records = asyncio.run(scenario())
    killed = events["killed"]
    new_replicas = {r["replica"] for r in records} - set(before) - {None}
    served_again = [r["end"] for r in records if r["replica"] in new_replicas and r["error"] is None]
    errors = [r for r in records if r["error"] is not None]
    result = {
        "replicas": len(before), "victim": victim, "kill_after_s": args.kill_after, "duration_s": args.duration,
        "summary": summary(records),
        "hung": sum(r["error"] == "hung" for r in records),
        "errors": [{"replica": r["replica"], "error": r["error"], "sent_after_kill_s": round(r["sent"] - killed, 3)}
                   for r in errors],
        "errors_off_the_victim": sum(r["replica"] != victim for r in errors),
        "requests_after_kill": sum(r["sent"] > killed for r in records),
        "replicas_back_after_s": events["replicas_back"] - killed if "replicas_back" in events else None,
        "new_replica_first_served_after_s": min(served_again) - killed if served_again else None,
    }
    result["targets"] = {"zero hung": result["hung"] == 0,
                         "errors only on the victim": result["errors_off_the_victim"] == 0,
                         "two replicas within 60 s": (result["replicas_back_after_s"] or 1e9) <= 60}
    return result


# ---- overhead ---------------------------------------------------------------------------------------------


def engine_flags(args) -> list[str]:
    """The same engine for both servers: the model serving.py's --model names (workload.resolve_model: the
    embedded model, or a random_models folder), --config, and on CPU --threads torch threads."""
    from workload import resolve_model

    model = resolve_model(args.model)
    flags = ["--config", args.config, *(["--model", str(model)] if model else [])]
    if args.config == "default":
        flags += ["--device", "cpu", "--num-threads", str(args.threads), "--max-num-seqs", str(max(args.streams, 8))]
    return flags


def serving_run(args, name: str, url: str | None) -> dict:
    """benchmarks/serving.py at --streams against `url`, or against a `graphserve serve` it launches."""
    from serving_level import Load, serving_level

    load = Load(args.model, args.streams, args.overhead_requests, args.min_len, args.max_len, args.client_procs)
    return serving_level(load, name, args.run_timeout, url=url, config=args.config, server_args=engine_flags(args))


def under_ray(args, round_index: int) -> dict:
    """One serving.py level against `graphserve serve --ray --replicas 1` (its own local Ray), then Ray stopped."""
    from live_server import free_port

    port = free_port()
    command = [sys.executable, "-m", "graphserve", "serve", "--ray", "--replicas", "1", "--port", str(port),
               *engine_flags(args)]
    log = open(Path(args.log_dir or tempfile.gettempdir()) / "ray_serving-overhead-ray.log", "a")
    ray_server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        deadline = time.monotonic() + args.server_timeout
        for line in ray_server.stdout:
            if line.startswith("graphserve ready"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("graphserve serve --ray did not say ready")
        else:
            raise RuntimeError(f"graphserve serve --ray exited with {ray_server.wait()}; see {log.name}")
        return serving_run(args, f"ray_serving-overhead-under-ray-{round_index}", f"http://127.0.0.1:{port}")
    finally:
        ray_server.send_signal(signal.SIGINT)
        try:
            ray_server.wait(60)
        except subprocess.TimeoutExpired:
            ray_server.kill()
        log.close()


def overhead(args) -> dict:
    """--rounds rounds, each Ray then direct, so that a shared machine's load swings reach both alike; the
    ratios are of the medians."""
    from serving_level import alternating_rounds

    result = {"streams": args.streams, "engine_flags": engine_flags(args),
              **alternating_rounds("under_ray", lambda i: under_ray(args, i), "direct",
                                   lambda i: serving_run(args, f"ray_serving-overhead-direct-{i}", None), args.rounds)}
    result["targets"] = {"tok/s >= 0.9x direct": result["tok_s_ratio"] >= 0.9,
                         "TTFT p50 within 1.2x": result["ttft_p50_ratio"] <= 1.2}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["routing", "kill", "overhead"])
    parser.add_argument("--nodes", type=int, default=2, help="Ray nodes (one replica each)")
    parser.add_argument("--cpus-per-node", type=int, default=1)
    parser.add_argument("--port", type=int, default=8600)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=384 * 1024**2,
                        help="per replica (routing: holds ~5.8 of the 8 prompts of 1,500 tokens)")
    parser.add_argument("--routers", nargs="+", default=["power-of-two", "prefix-affinity"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="a request with no answer by then hung")
    parser.add_argument("--duration", type=float, default=60.0, help="kill: seconds of load")
    parser.add_argument("--kill-after", type=float, default=15.0)
    parser.add_argument("--recovery-timeout", type=float, default=120.0)
    parser.add_argument("--model", default="default", help="overhead: serving.py's --model (its vocabulary)")
    parser.add_argument("--config", default="default", help="overhead: the server's config (gpu-h200 on a GPU)")
    parser.add_argument("--threads", type=int, default=1, help="overhead on CPU: the engine's torch threads")
    parser.add_argument("--overhead-requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="overhead: rounds of (under Ray, direct)")
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument("--server-timeout", type=float, default=600.0)
    parser.add_argument("--run-timeout", type=float, default=900.0)
    parser.add_argument("--out", default=str(BENCH / "results"))
    parser.add_argument("--log-dir", default=None, help="overhead: where the Ray server's log goes (default: /tmp)")
    parser.add_argument("--name", default=None, help="file name stem (default ray_serving-PART-cpu-DATE)")
    args = parser.parse_args()
    if args.part == "kill":
        args.max_tokens = 64 if args.max_tokens == 32 else args.max_tokens
        args.kv_cache_bytes = 64 * 1024**2 if args.kv_cache_bytes == 384 * 1024**2 else args.kv_cache_bytes
    Path(args.out).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = {"routing": routing, "kill": kill, "overhead": overhead}[args.part](args)
    result.update(args={k: v for k, v in vars(args).items()}, total_s=time.perf_counter() - started,
                  provenance=provenance(f"ray_serving {args.part}"))
    name = args.name or f"ray_serving-{args.part}-cpu-{dt.date.today().isoformat()}"
    write_json(Path(args.out) / f"{name}.json", result)
    print(json.dumps({k: v for k, v in result.items() if k in ("targets", "ttft_p50_ratio", "tok_s_ratio")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
