"""Where a CPU decode step's time goes: the embedded model in-process (`LLM`), B concurrent
prompts of the serving benchmark's lengths, decode rounds timed by wall clock, then one
round under torch.profiler (op self-times per step).

    python benchmarks/cpu_profile.py --batch 1 8 16 [--threads 2] [--rounds 6] [--profile] [--dtype float32]

Prompts: random token ids, 128-256 tokens (as benchmarks/serving.py --min-len 128 --max-len 256)
plus 0-255 more, standing for the tokens a stream of the serving benchmark has already generated
(its contexts spread over 128-512), greedy, ignore_eos. Reported per batch size: ms per decode step (a round of K steps / K),
tok/s of decode alone, and with --profile the top ops by self CPU time per step.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(llm, batch: int, rounds: int, profile: bool, top: int, seed: int = 0) -> dict:
    from graphserve import SamplingParams

    core = llm.engine.core
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(batch):
        n = rng.randint(128, 256) + rng.randrange(256)
        core.add_request(f"b{batch}-{i}", [rng.randrange(1000, 40000) for _ in range(n)], params)
    # prefill everything (and the first decode rounds)
    while any(s.in_prefill or s.num_output_tokens == 0 for s in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    k = core.config.decode_chunk
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    times.sort()
    step_ms = 1000 * times[len(times) // 2] / k
    result = dict(batch=batch, k=k, step_ms_median=step_ms, step_ms_min=1000 * times[0] / k,
                  decode_tok_s=batch / step_ms * 1000)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            core.step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events)
        rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
        result["profile_total_ms_per_step"] = total / 1000 / k
        result["profile"] = [dict(op=e.key, self_ms_per_step=e.self_cpu_time_total / 1000 / k,
                                  calls_per_step=e.count / k) for e in rows]
    for rid in list(core.sequences):
        core.abort(rid)
    while core.has_unfinished():
        core.step()
    return result


def prefill(llm, lengths: list[int], repeats: int = 3) -> dict:
    """Seconds of the prefill step(s) of prompts of these lengths submitted together (best of
    `repeats`; max_tokens 1, so nothing but the prefill and the first token)."""
    from graphserve import SamplingParams

    core = llm.engine.core
    rng = random.Random(1)
    best = None
    for r in range(repeats):
        for i, n in enumerate(lengths):
            # distinct prompts each time, so the prefix cache never hits
            core.add_request(f"p{r}-{i}", [rng.randrange(1000, 40000) for _ in range(n)],
                             SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        t = time.perf_counter()
        while core.has_unfinished():
            core.step()
        t = time.perf_counter() - t
        best = t if best is None else min(best, t)
    return dict(prompt_tokens=sum(lengths), prompts=len(lengths), seconds=best, tok_s=sum(lengths) / best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--decode-chunk", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--prefill", type=int, nargs="*", default=[],
                        help="also time the prefill of this many 190-token prompts submitted together")
    parser.add_argument("--dtype", default="auto",
                        help="auto: the embedded model's Q4_1 blocks (the default server); float32: dequantized")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from graphserve import LLM

    llm = LLM(device="cpu", dtype=args.dtype, num_threads=args.threads, decode_chunk=args.decode_chunk)
    out = dict(threads=torch.get_num_threads(), torch=torch.__version__, command=" ".join(sys.argv), results=[])
    run(llm, 2, 2, False, 0)  # warm-up
    for b in args.batch:
        r = run(llm, b, args.rounds, args.profile, args.top)
        out["results"].append(r)
        print(f"batch {b:3d}: {r['step_ms_median']:7.2f} ms/step (min {r['step_ms_min']:.2f}), "
              f"{r['decode_tok_s']:7.1f} tok/s", flush=True)
        if args.profile:
            print(f"  profiled op self time: {r['profile_total_ms_per_step']:.2f} ms/step")
            for row in r["profile"]:
                print(f"  {row['self_ms_per_step']:8.3f} ms {row['calls_per_step']:8.1f} calls  {row['op']}")
    for n in args.prefill:
        r = prefill(llm, [190] * n)
        out.setdefault("prefill", []).append(r)
        print(f"prefill {n} x 190 tokens: {r['seconds']:.3f} s, {r['tok_s']:.0f} tok/s", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
