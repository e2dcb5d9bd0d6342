"""Offline throughput through the engine API (no HTTP): every request of the shared
request set (benchmarks/workload.py: 1,000 requests, prompt and output lengths uniform in
100-1,024 tokens, token-id prompts, ignore_eos) submitted at once, then the engine
stepped until all finish. Reports output tokens/s and total (prompt + output) tokens/s
over the whole run, and the engine's counters over it (decode rounds, rounds launched
ahead, graph replays, preemptions, ...).

    python benchmarks/throughput.py --model qwen2.5-0.5b --config configs/gpu-h200.toml --out $OUT
    python benchmarks/throughput.py --model default --device cpu --num-requests 16 --min-len 8 --max-len 32 --out /tmp/t

Engine settings: the --config file's [engine] table (default: configs/gpu-h200.toml when
CUDA is there, else configs/default.toml), then the flags below, then any --set KEY=VALUE
(an EngineConfig field; the value is read as TOML, else as a string)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from workload import describe, make_requests, provenance, resolve_model, vocabulary, write_json  # noqa: E402

ENGINE_FLAGS = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_chunk",
                "gpu_memory_utilization", "num_kv_blocks", "num_threads", "cuda_graph_max_batch")


def parse_value(text: str):
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """--device ... --cuda-graph-max-batch and --enforce-eager (what engine_config reads, with --set and
    --no-prefix-caching, which each benchmark adds with its own help)."""
    for flag in ENGINE_FLAGS:
        kind = str if flag in ("device", "dtype") else float if flag == "gpu_memory_utilization" else int
        parser.add_argument("--" + flag.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--enforce-eager", action="store_true")


def engine_parser(description: str, model: str = "qwen2.5-0.5b") -> argparse.ArgumentParser:
    """A parser with what engine_config reads (--model, --config, the engine flags, --set,
    --no-prefix-caching) and --out / --name, for a benchmark to add its own flags to."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default=model, help="a random_models config, 'default' or a model folder")
    parser.add_argument("--config", default=None, help="engine settings file (a path or a name in configs/)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the JSON")
    parser.add_argument("--name", default=None, help="JSON file name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any EngineConfig field")
    parser.add_argument("--no-prefix-caching", action="store_true")
    add_engine_flags(parser)
    return parser


def engine_config(args: argparse.Namespace, model: str | None):
    """EngineConfig from the config file < flags < --set, as `graphserve serve` merges them."""
    from graphserve.server.settings import ENGINE_KEYS, merge_settings, read_config_file, resolve_config_path

    config_name = args.config
    if config_name is None:
        import torch

        config_name = "gpu-h200" if torch.cuda.is_available() and args.device != "cpu" else "default"
    path = resolve_config_path(config_name)
    flags = {k: getattr(args, k) for k in ENGINE_FLAGS}
    if args.enforce_eager:
        flags["enforce_eager"] = True
    if args.no_prefix_caching:
        flags["prefix_caching"] = False
    for item in args.set:
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in ENGINE_KEYS:
            raise SystemExit(f"--set {key}: not an engine setting ({', '.join(sorted(ENGINE_KEYS))})")
        flags[key] = parse_value(value.strip())
    flags["model"] = model
    _, engine = merge_settings(read_config_file(path), flags)
    engine.model = model  # None (the embedded model) too, which merge_settings treats as "not given"
    return path, engine


def stats_delta(before: dict, after: dict) -> dict:
    """after - before for counters (numbers, and dicts of numbers per key); gauges as after."""
    gauges = {"num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached_free",
              "grammar_requests"}
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if key in gauges or old is None:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = {str(k): v - old.get(k, 0) for k, v in value.items() if v - old.get(k, 0)}
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = value - old
        else:
            out[key] = value
    return out


def engine_stats(llm) -> dict:
    try:
        return dataclasses.asdict(llm.engine.stats())
    except Exception as e:  # a changed engine API must not lose the throughput figures
        return {"error": repr(e)}


def run(llm, requests, temperature: float, timeout: float, progress_every: float = 10.0) -> dict:
    """Submit all, step until all finish (or the timeout); the time and tokens of it."""
    from graphserve import SamplingParams

    engine = llm.engine
    expected = {}
    start = time.perf_counter()
    for i, req in enumerate(requests):
        rid = f"bench-{i}"
        engine.add_request(rid, req.prompt, SamplingParams(max_tokens=req.max_tokens, temperature=temperature,
                                                           ignore_eos=True))
        expected[rid] = req.max_tokens
    submitted = time.perf_counter()
    generated = {rid: 0 for rid in expected}
    finished: dict[str, str | None] = {}
    next_report = start + progress_every
    timed_out = False
    while len(finished) < len(expected):
        for out in engine.step():
            generated[out.request_id] += len(out.token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        now = time.perf_counter()
        if now >= next_report:
            print(f"  {now - start:6.1f}s: {len(finished)}/{len(expected)} finished, "
                  f"{sum(generated.values()) / (now - start):,.0f} output tok/s so far", flush=True)
            next_report = now + progress_every
        if now - start > timeout:
            timed_out = True
            for rid in expected:
                if rid not in finished:
                    engine.abort(rid)
            break
    try:  # a device still working counts in the time
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        pass
    elapsed = time.perf_counter() - start
    done = [rid for rid in finished]
    output_tokens = sum(generated.values())
    prompt_tokens = sum(len(r.prompt) for r in requests)
    reasons: dict[str, int] = {}
    for reason in finished.values():
        reasons[str(reason)] = reasons.get(str(reason), 0) + 1
    return dict(elapsed_s=elapsed, submit_s=submitted - start, finished=len(done), timed_out=timed_out,
                finish_reasons=reasons,
                short=sum(1 for rid in done if generated[rid] != expected[rid]),
                output_tokens=output_tokens, prompt_tokens=prompt_tokens,
                output_tok_s=output_tokens / elapsed,
                total_tok_s=(output_tokens + prompt_tokens) / elapsed if not timed_out else None,
                requests_per_s=len(done) / elapsed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b",
                        help="a random_models config (qwen2.5-0.5b, llama-3.1-8b), 'default' (the embedded model) "
                             "or a model folder")
    parser.add_argument("--config", default=None, help="engine settings file (a path or a name in configs/)")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0, help="of the request set")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--warmup-requests", type=int, default=4, help="short requests run first, not timed")
    parser.add_argument("--timeout", type=float, default=480.0, help="abort what is left after this many seconds")
    add_engine_flags(parser)
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="prefix caching off (the request set's random prompts never hit; issue 10 compares both)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any EngineConfig field")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder for the JSON")
    parser.add_argument("--name", default=None, help="JSON file name (default throughput-MODEL.json)")
    args = parser.parse_args()

    model = resolve_model(args.model)
    config_path, config = engine_config(args, model)
    vocab_size, specials = vocabulary(model)
    requests = make_requests(args.num_requests, args.min_len, args.max_len, vocab_size, specials, args.seed)
    workload = describe(requests)
    print(f"{args.model}: {workload['num_requests']} requests, {workload['prompt_tokens']:,} prompt + "
          f"{workload['output_tokens']:,} output tokens; engine {config}", flush=True)

    from graphserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(**dataclasses.asdict(config))
    load_s = time.perf_counter() - started
    warm = make_requests(args.warmup_requests, 16, 32, vocab_size, specials, args.seed + 1)
    if warm:
        llm.generate([r.prompt for r in warm], SamplingParams(max_tokens=24, temperature=args.temperature,
                                                              ignore_eos=True))
    before = engine_stats(llm)
    result = run(llm, requests, args.temperature, args.timeout)
    after = engine_stats(llm)
    result["engine_stats"] = stats_delta(before, after) if "error" not in after else after
    idle, busy = result["engine_stats"].get("device_idle_seconds"), result["engine_stats"].get("device_busy_seconds")
    result["gpu_idle_ratio"] = idle / (idle + busy) if idle is not None and busy is not None and idle + busy else None
    print(f"{args.model}: {result['finished']}/{len(requests)} requests in {result['elapsed_s']:.1f}s -> "
          f"{result['output_tok_s']:,.0f} output tok/s, "
          f"{(result['total_tok_s'] or 0):,.0f} total tok/s{' (TIMED OUT)' if result['timed_out'] else ''}",
          flush=True)
    print(f"  engine: {result['engine_stats']}", flush=True)

    report = dict(**provenance("throughput"), model=args.model, model_path=str(model) if model else None,
                  config_file=str(config_path), engine_config=dataclasses.asdict(config),
                  engine_load_s=load_s, workload=dict(**workload, min_len=args.min_len, max_len=args.max_len,
                                                       seed=args.seed, temperature=args.temperature,
                                                       ignore_eos=True, prompts="token ids"),
                  **result)
    name = args.name or f"throughput-{Path(str(model)).name if model else 'default'}.json"
    write_json(Path(args.out) / name, report)
    return 1 if result["timed_out"] else 0


if __name__ == "__main__":
    sys.exit(main())
