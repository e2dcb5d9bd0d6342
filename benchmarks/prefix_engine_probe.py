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


class StepTimer:
    """Host time of the core's parts, summed until reset(): scheduling, each prefill step, and
    within it the model forward's launch (host) and, after a device sync, its remaining device
    time (the syncs add nothing the step does not wait for anyway: it reads tokens back)."""

    def __init__(self, core):
        import torch

        self.parts: dict[str, float] = {}
        scheduler, runner = core.scheduler, core.runner
        schedule, prefill = scheduler.schedule, runner.prefill

        def timed(name, fn):
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.add(name, time.perf_counter() - t)
            return wrapper

        scheduler.schedule = timed("schedule", schedule)
        runner.prefill = timed("prefill", prefill)
        cuda = runner.device.type == "cuda"
        marks = {}

        def before(module, args):
            if cuda:
                torch.cuda.synchronize()
            marks["t"] = time.perf_counter()

        def after(module, args, output):
            t = time.perf_counter()
            self.add("forward_launch", t - marks["t"])
            if cuda:
                torch.cuda.synchronize()
            self.add("forward_device_after_launch", time.perf_counter() - t)

        runner.model.register_forward_pre_hook(before)
        runner.model.register_forward_hook(after)

    def add(self, name: str, seconds: float) -> None:
        self.parts[name] = self.parts.get(name, 0.0) + seconds

    def reset(self) -> dict[str, float]:
        parts, self.parts = {k: round(1e3 * v, 2) for k, v in self.parts.items()}, {}
        return parts


def run_waves(llm, prompts: list[list[int]], concurrency: int, max_tokens: int, profile_wave: int = -1,
              cprofile_wave: int = -1, timer: StepTimer | None = None) -> list[dict]:
    from graphserve import SamplingParams

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
        if timer is not None:
            timer.reset()
        start = time.perf_counter()
        ids = [f"w{w}-{i}" for i in range(len(batch))]
        for rid, prompt in zip(ids, batch):
            engine.add_request(rid, prompt, params)
        submit_s = time.perf_counter() - start
        first: dict[str, float] = {}
        steps_to_first, steps, parts_ms = 0, 0, None
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
                        parts_ms = timer.reset() if timer is not None else None
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
                          submit_ms=1e3 * submit_s, admission_ms=1e3 * admit_s,
                          **({"until_first_ms": parts_ms} if parts_ms else {}), **({"profile": profile_tables} if profile_tables else {})))
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
    parser.add_argument("--timing", action="store_true",
                        help="per wave, the core's host time until every first token: scheduling, prefill, "
                             "the forward's launch and its device time after (device syncs around the forward)")
    args = parser.parse_args()

    from graphserve import LLM

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
        timer = StepTimer(llm.engine.core) if args.timing else None
        waves = run_waves(llm, prompts, args.concurrency, args.max_tokens, args.profile_wave if caching else -1,
                          args.cprofile_wave if caching else -1, timer)
        report["runs"]["on" if caching else "off"] = waves
        for i, wave in enumerate(waves):
            print(f"caching {'on ' if caching else 'off'} wave {i}: " + ", ".join(
                f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in wave.items() if k not in ("profile", "until_first_ms")) +
                  (f"\n    until every first token (ms): {wave['until_first_ms']}" if "until_first_ms" in wave else ""),
                  flush=True)
        del llm
    path = Path(args.out) / (args.name or f"prefix-engine-probe-{args.model}.json")
    write_json(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
