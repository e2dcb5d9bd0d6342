"""Where a decode step's time goes on the GPU: CUDA kernel times of eager decode steps
(torch.profiler), against the wall time of the same step replayed as a CUDA graph.

    python benchmarks/profile_decode.py --model qwen2.5-0.5b --batch 1 --out profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from random_models import random_model, random_model_config  # noqa: E402

K = 8  # decode steps per round: the profiled eager round and the timed graph rounds


def critical_path(spans: list[tuple[str, float, float]]) -> dict[str, dict[str, float]]:
    """Per kernel name, from (name, start, end) device spans: `exposed`, the time it kept the GPU
    busy past every kernel that started before it (the step's span is their sum plus the idle
    time), and `idle_before`, the time nothing ran before it started. Under PDL kernels overlap,
    so summed durations overcount; this attributes the span itself."""
    out: dict[str, dict[str, float]] = {}
    busy_until = None
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        entry = out.setdefault(name, dict(count=0, exposed=0.0, idle_before=0.0))
        entry["count"] += 1
        if busy_until is None:
            busy_until = start
        entry["idle_before"] += max(0.0, start - busy_until)
        entry["exposed"] += max(0.0, end - max(busy_until, start))
        busy_until = max(busy_until, end)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none")
    parser.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                        help="dummy: random weights made on the GPU from the config alone (no files)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from graphserve import LLM, SamplingParams

    path = random_model_config(args.model) if args.load_format == "dummy" else random_model(args.model)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=max(args.batch, 1),
              max_model_len=512, decode_chunk=K, load_format=args.load_format,
              quantization=None if args.quantization == "none" else args.quantization)
    engine = llm.engine.core
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"p{i}", list(range(100 + i, 228 + i)), params)
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()  # prefill steps, within the token budget
    rnd = engine.scheduler.schedule()  # the first decode round, its KV blocks reserved
    assert rnd.num_steps == K and len(rnd.seqs) == args.batch

    def timed(fn, n=20):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / n / K

    graph_step = timed(lambda: engine.worker.graphs.collect(engine.worker.graphs.launch(rnd)))
    eager_step = timed(lambda: engine.worker.runner.decode(rnd), n=5)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        engine.worker.runner.decode(rnd)
        torch.cuda.synchronize()
    # the same step as one CUDA graph replay: kernel time inside the graph vs the replay's span
    entry = engine.worker.graphs.graphs[(engine.worker.graphs.bucket_for(args.batch), "greedy")]
    replays = 20
    steps = engine.worker.graphs.max_steps  # a replay reads step `step` of the round's [K, B] buffers

    def replay(i: int) -> None:
        if i % steps == 0:
            engine.worker.graphs.buffers.step.zero_()
        entry.graph.replay()

    with profile(activities=[ProfilerActivity.CUDA]) as graph_prof:
        for i in range(replays):
            replay(i)
        torch.cuda.synchronize()
    graph_kernels = [e for e in graph_prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0]
    graph_kernel_us = sum(e.device_time_total for e in graph_kernels) / replays
    graph_counts: dict[str, list[float]] = {}
    for e in graph_kernels:
        graph_counts.setdefault(e.name[:120], []).append(e.device_time_total)
    graph_top = sorted(((k, len(v) / replays, sum(v) / replays) for k, v in graph_counts.items()), key=lambda t: -t[2])
    path = critical_path([(e.name[:120], e.time_range.start, e.time_range.end) for e in graph_kernels])
    path_top = sorted(path.items(), key=lambda kv: -(kv[1]["exposed"] + kv[1]["idle_before"]))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replays_us(n: int) -> float:
        start.record()
        for i in range(n):
            replay(i)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / n

    replay_us = replays_us(replays)
    # the same replays for about as long as graph_ms_per_step's rounds ran (does a sustained load
    # run slower, e.g. lower clocks?), then those rounds again
    long_replays = max(replays, int(21 * K * graph_step * 1e6 / replay_us))
    replay_long_us = replays_us(long_replays)
    graph_step_again = timed(lambda: engine.worker.graphs.collect(engine.worker.graphs.launch(rnd)))

    kernels = {}
    for evt in prof.key_averages():
        if evt.self_device_time_total > 0:  # a kernel (CPU-side ops carry no self device time)
            kernels[evt.key] = dict(count=evt.count, device_us=evt.self_device_time_total / K)
    total = sum(v["device_us"] for v in kernels.values())
    launches = sum(v["count"] for v in kernels.values()) / K
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["device_us"])[:25]
    result = dict(model=args.model, batch=args.batch, quantization=args.quantization, graph_ms_per_step=graph_step * 1e3,
                  eager_ms_per_step=eager_step * 1e3, kernel_time_us_per_step=total, kernels_per_step=launches,
                  top_kernels=[dict(name=k[:120], **v) for k, v in top],
                  graph_replay_us=replay_us, graph_replay_long_us=replay_long_us, long_replays=long_replays,
                  graph_ms_per_step_again=graph_step_again * 1e3, graph_kernel_us=graph_kernel_us,
                  graph_kernels_per_step=len(graph_kernels) / replays,
                  graph_top_kernels=[dict(name=k, per_step=c, device_us=t) for k, c, t in graph_top[:30]],
                  graph_critical_path=[dict(name=k, per_step=v["count"] / replays, exposed_us=v["exposed"] / replays,
                                            idle_before_us=v["idle_before"] / replays) for k, v in path_top[:30]],
                  gpu=torch.cuda.get_device_name(),
                  command=" ".join(sys.argv))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{args.model} {args.quantization} B={args.batch}: graph {graph_step * 1e3:.3f} ms/step, eager {eager_step * 1e3:.3f} ms/step, "
          f"sum of kernel times {total / 1e3:.3f} ms/step over ~{launches:.0f} kernel launches")
    print(f"graph replay over {long_replays} replays {replay_long_us:.1f} us/step; rounds again "
          f"{graph_step_again * 1e3:.3f} ms/step")
    print(f"graph replay {replay_us:.1f} us/step: kernels {graph_kernel_us:.1f} us over {len(graph_kernels) / replays:.0f} "
          f"kernels, so {replay_us - graph_kernel_us:.1f} us between kernels")
    for name, count, t in graph_top[:20]:
        print(f"  {t:8.1f} us  x{count:5.1f}  {name[:90]}")
    print("the replay's span by kernel (exposed: busy past the kernels before it; idle: nothing ran before it), us/step:")
    for name, v in path_top[:20]:
        print(f"  exposed {v['exposed'] / replays:8.1f}  idle {v['idle_before'] / replays:7.1f}  "
              f"x{v['count'] / replays:5.1f}  {name[:80]}")


if __name__ == "__main__":
    main()
