"""What the GPU benchmarks share: timing helpers, the copy bandwidth they compare against, and
the provenance every results file carries."""

from __future__ import annotations

import datetime as dt
import functools
import json
import platform
import sys
from pathlib import Path

import torch


def bench_ms(fn, rep: int) -> float:
    """Median ms per call, launch overhead included (triton's do_bench, L2 flushed between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


def copy_bandwidth(mib: int = 2048, rep: int = 100) -> dict:
    """Device-to-device copy of `mib` MiB: bytes read + written per second."""
    n = mib * 1024 * 1024
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(functools.partial(dst.copy_, src), rep)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_moved": 2 * n, "ms": ms, "gb_per_s": 2 * n / ms / 1e6}


def graph_ms(fns: list, min_calls: int = 40, replays: int = 15) -> float:
    """Median time per call of `fns` captured into one CUDA graph (how the engine runs decode)."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    rounds = max(1, -(-min_calls // len(fns)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in fns:
                fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(fns)))
    del graph
    return sorted(times)[len(times) // 2]


def run_info(benchmark: str) -> dict:
    """GPU, library versions, command line and time of a benchmark run."""
    import triton

    info = dict(benchmark=benchmark, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, python=platform.python_version(), command=" ".join(sys.argv),
                date=dt.datetime.now().isoformat(timespec="seconds"))
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def write_json(path: Path | str, result: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
