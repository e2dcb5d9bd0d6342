"""Time to first token of prefix_bench.py's workload inside the engine (no HTTP, no front
end, no client): waves of C requests sharing a P-token prefix with distinct S-token suffixes,
each wave submitted at once when the one before has ended, through the offline engine API
with prefix caching on and off. Per wave: TTFT (submit -> the step that returned the first
token) p50/max, the engine's steps until then, and host time spent in admission.
Tells how much of the served TTFT the engine itself accounts for.

    python benchmarks/prefix_engine_probe.py --model qwen2.5-0.5b --config configs/gpu-h200.toml --out $OUT
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import engine_config, engine_parser  # noqa: E402
from workload import provenance, resolve_model, vocabulary, write_json  # noqa: E402


def run_waves(llm, prompts: list[list[int]], concurrency: int, max_tokens: int, profile_wave: int = -1,
              cprofile_wave: int = -1) -> list[dict]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine = llm.engine
    scheduler = engine.core.scheduler
    waves = []
    for w in range(0, len(prompts), concurrency):
        batch = prompts[w:w + concurrency]
        admit_s = 0.0
        cached_prefix = scheduler.blocks.cached_prefix

        def timed(*args, _f=cached_prefix):
            nonlocal admit_s
            t = time.perf_counter()
            out = _f(*args)
            admit_s += time.perf_counter() - t
            return out

        scheduler.blocks.cached_prefix = timed
        start = time.perf_counter()
        ids = [f"w{w}-{i}" for i in range(len(batch))]
        for rid, prompt in zip(ids, batch):
            engine.add_request(rid, prompt, params)
        submit_s = time.perf_counter() - start
        first: dict[str, float] = {}
        steps_to_first, steps = 0, 0
        prof, profile_tables, cprof = None, None, None
        if w // concurrency == cprofile_wave:
            import cProfile

            cprof = cProfile.Profile()
            cprof.enable()
        if w // concurrency == profile_wave:
            import torch

            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        while engine.has_unfinished():
            outs = engine.step()
            steps += 1
            now = time.perf_counter() - start
            for out in outs:
                if out.token_ids and out.request_id not in first:
                    first[out.request_id] = now
                    if len(first) == len(batch):
                        steps_to_first = steps
            if cprof is not None and len(first) == len(batch):
                cprof.disable()
            if prof is not None and len(first) == len(batch):
                prof.__exit__(None, None, None)
                host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
                device = prof.key_averages().table(sort_by="self_device_time_total", row_limit=15)
                print(host, device, sep="\n", flush=True)
                profile_tables = dict(host=host.splitlines(), device=device.splitlines())
                prof = None
        if cprof is not None:  # Python time of the wave up to every first token, by function
            import io
            import pstats

            cprof.disable()
            text = io.StringIO()
            pstats.Stats(cprof, stream=text).sort_stats("cumtime").print_stats(40)
            print(text.getvalue(), flush=True)
            profile_tables = dict(profile_tables or {}, python=text.getvalue().splitlines())
        scheduler.blocks.cached_prefix = cached_prefix
        ttft = sorted(first.values())
        waves.append(dict(ttft_p50_ms=1e3 * statistics.median(ttft), ttft_max_ms=1e3 * ttft[-1],
                          wave_ms=1e3 * (time.perf_counter() - start), steps_to_all_first=steps_to_first,
                          submit_ms=1e3 * submit_s, admission_ms=1e3 * admit_s, **({"profile": profile_tables} if profile_tables else {})))
    return waves


def main() -> int:
    parser = engine_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--profile-wave", type=int, default=-1, help="torch.profiler over this wave's first tokens")
    parser.add_argument("--cprofile-wave", type=int, default=-1, help="cProfile over this wave's first tokens")
    args = parser.parse_args()

    from engine import LLM

    model = resolve_model(args.model)
    vocab_size, specials = vocabulary(model)
    rng = random.Random(0)
    allowed = [t for t in range(100, min(vocab_size, 30000)) if t not in specials]
    report = dict(**provenance("prefix_engine_probe"), model=args.model, prefix_tokens=args.prefix,
                  suffix_tokens=args.suffix, concurrency=args.concurrency, max_tokens=args.max_tokens, runs={})
    for caching in (True, False):
        args.no_prefix_caching = not caching
        _, config = engine_config(args, model)
        llm = LLM(**dataclasses.asdict(config))
        run_waves(llm, [[rng.choice(allowed) for _ in range(64)] for _ in range(4)], 4, 4)  # warm-up
        prefix = [rng.choice(allowed) for _ in range(args.prefix)]
        prompts = [prefix + [rng.choice(allowed) for _ in range(args.suffix)] for _ in range(args.requests)]
        waves = run_waves(llm, prompts, args.concurrency, args.max_tokens, args.profile_wave if caching else -1,
                          args.cprofile_wave if caching else -1)
        report["runs"]["on" if caching else "off"] = waves
        for i, wave in enumerate(waves):
            print(f"caching {'on ' if caching else 'off'} wave {i}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in wave.items() if k != "profile"), flush=True)
        del llm
    path = Path(args.out) / (args.name or f"prefix-engine-probe-{args.model}.json")
    write_json(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
