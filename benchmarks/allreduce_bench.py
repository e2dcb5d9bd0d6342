"""Issue 11: the all-reduce of a tensor-parallel decode step, NCCL against a one-shot all-reduce
over CUDA IPC buffers (torch's symmetric memory, NVLink multicast off), for the small messages a
decode step sums (rows x hidden bf16: 1 x 4096 to 256 x 8192), each timed inside a CUDA graph as
the engine replays it. Needs N GPUs of one host; on CPU (gloo) only the harness runs.

    python benchmarks/allreduce_bench.py --tp 2 --out benchmarks/results/allreduce-h200x2.json

Each rank checks the sums against the same sums done on the host, then times `calls` all-reduces
captured back to back in one graph. Per message: microseconds per call and bus bandwidth
(2 (N-1)/N x bytes / time, NCCL's convention).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SHAPES = [(1, 4096), (8, 4096), (64, 4096), (256, 4096), (1, 8192), (64, 8192), (256, 8192)]


def _graph_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def _rank(rank: int, size: int, init_method: str, calls: int, shapes: list[tuple[int, int]]) -> list[dict]:
    from graphserve.engine.distributed import init_tensor_parallel

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    tp = init_tensor_parallel(rank, size, device, init_method)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    symm = None
    if cuda:
        import torch.distributed._symmetric_memory as symm_mem

        symm = symm_mem
        group_name = tp.group.group_name
    for shape in shapes:
        gen = torch.Generator().manual_seed(rank * 1000 + shape[0])
        host = [torch.randn(shape, generator=torch.Generator().manual_seed(r * 1000 + shape[0])) for r in range(size)]
        want = sum(h.float() for h in host).to(dtype)
        x = torch.randn(shape, generator=gen).to(device, dtype)
        assert torch.equal(x.cpu(), host[rank].to(dtype))
        row = dict(rows=shape[0], hidden=shape[1], bytes=x.numel() * x.element_size())
        nccl = x.clone()
        dist.all_reduce(nccl, group=tp.group)
        row["nccl_max_err"] = (nccl.cpu().float() - want.float()).abs().max().item()
        if cuda:
            work = x.clone()
            row["nccl_us"] = _graph_us(lambda: dist.all_reduce(work, group=tp.group), calls)
            buf = symm.empty(shape, dtype=dtype, device=device)
            symm.rendezvous(buf, group_name)
            buf.copy_(x)
            out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
            row["one_shot_max_err"] = (out.cpu().float() - want.float()).abs().max().item()
            row["one_shot_us"] = _graph_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name),
                                           calls)
            for kind in ("nccl", "one_shot"):
                row[f"{kind}_bus_gb_s"] = 2 * (size - 1) / size * row["bytes"] / row[f"{kind}_us"] / 1e3
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--calls", type=int, default=64, help="all-reduces per graph replay")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/allreduce.json"))
    args = parser.parse_args()

    from graphserve.engine.distributed import run_on_ranks
    from measure import run_info, write_json
    from workload import provenance

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    rows = run_on_ranks(_rank, args.tp, (args.calls, SHAPES), timeout=600)[0]
    for r in rows:
        line = f"{r['rows']:4d} x {r['hidden']:5d} ({r['bytes'] / 1024:7.1f} KiB)  max err {r['nccl_max_err']:.3g}"
        if "nccl_us" in r:
            line += (f"  NCCL {r['nccl_us']:7.2f} us  one-shot {r['one_shot_us']:7.2f} us"
                     f" (err {r['one_shot_max_err']:.3g})")
        print(line, flush=True)
    info = run_info("allreduce_bench") if torch.cuda.is_available() else provenance("allreduce_bench")
    write_json(args.out, dict(**info, tensor_parallel_size=args.tp, calls_per_graph=args.calls, rows=rows))


if __name__ == "__main__":
    main()
