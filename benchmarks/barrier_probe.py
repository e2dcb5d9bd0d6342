"""What a kernel boundary costs at a decode step's scale, against a grid-wide barrier inside one
persistent kernel: the question a persistent ("megakernel") decoder turns on. Needs CUDA.

    python benchmarks/barrier_probe.py [--programs 132 528] [--phases 64] [--out PATH]

Both run the same chain of `phases` dependent steps over P programs, with no weights: in each step
every program reads the value another program wrote in the step before (through L2) and writes its
own, so each step waits for the whole one before it, as a decoder's kernels wait for each other.
- chain: one kernel a step, launched with programmatic dependent launch (kernels/_pdl.py) as the
  engine's decode kernels are, or without it; all of it captured in a CUDA graph;
- persistent: one kernel of P programs (all resident at once) doing every step, the steps separated
  by a grid barrier: each program counts itself in on a counter in global memory (release, at GPU
  scope, after all its threads' stores) and spins until every program has (acquire).
The µs a step of each is what the chain's boundaries cost against the barrier's. A decode step of
Qwen2.5-0.5B at batch 1 has 128 kernels (profile_decode-qwen2.5-0.5b-b1-h200-2026-12-02-*.json).
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure import graph_ms, run_info, write_json  # noqa: E402

from kernels._pdl import wait_for_previous_kernel  # noqa: E402


@triton.jit
def _chain_step_kernel(src_ptr, dst_ptr, P, PDL: tl.constexpr):
    """dst[p] = src[(p + 1) % P] + 1, after the kernel before (which wrote src) finished."""
    p = tl.program_id(0)
    if PDL:
        wait_for_previous_kernel()
    tl.store(dst_ptr + p, tl.load(src_ptr + (p + 1) % P) + 1)


@triton.jit
def _persistent_kernel(buf_ptr, counter_ptr, P, PHASES: tl.constexpr):
    """buf [PHASES + 1, P]: row s + 1 from row s as one chain step does, the rows separated by a grid
    barrier. counter_ptr: an int32 0 at launch. Every program must be resident (P at most the GPU's
    capacity), or the spin never ends."""
    p = tl.program_id(0)
    for step in range(PHASES):
        v = tl.load(buf_ptr + step * P + (p + 1) % P, cache_modifier=".cg")  # L2: never a stale L1 line
        tl.store(buf_ptr + (step + 1) * P + p, v + 1)
        tl.debug_barrier()  # every thread's store before the arrival
        tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
        target = (step + 1) * P
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


def chain(buf: torch.Tensor, pdl: bool) -> None:
    """buf [phases + 1, P] int32: row s + 1 = row s rotated by one, plus one, a kernel a row."""
    phases, programs = buf.shape[0] - 1, buf.shape[1]
    for s in range(phases):
        _chain_step_kernel[(programs,)](buf[s], buf[s + 1], programs, PDL=pdl, num_warps=4, launch_pdl=pdl)


def persistent(buf: torch.Tensor, counter: torch.Tensor) -> None:
    """chain's result in one kernel with a grid barrier between rows (needs CUDA: the interpreter runs
    programs one after another, so the first to spin would wait forever)."""
    phases, programs = buf.shape[0] - 1, buf.shape[1]
    counter.zero_()
    _persistent_kernel[(programs,)](buf, counter, programs, PHASES=phases, num_warps=4)


def chain_ref(first: torch.Tensor, phases: int) -> torch.Tensor:
    rows = [first]
    for _ in range(phases):
        rows.append(torch.roll(rows[-1], -1) + 1)
    return torch.stack(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", nargs="+", type=int, default=[132, 528])
    p.add_argument("--phases", type=int, default=64)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results" / f"barrier_probe-{dt.date.today()}.json")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for programs in args.programs:
        first = torch.arange(programs, dtype=torch.int32, device=dev)
        want = chain_ref(first, args.phases)
        buf = torch.zeros(args.phases + 1, programs, dtype=torch.int32, device=dev)
        buf[0] = first
        counter = torch.zeros(1, dtype=torch.int32, device=dev)
        runs = {"chain, PDL": lambda: chain(buf, True), "chain, no PDL": lambda: chain(buf, False),
                "persistent, grid barrier": lambda: persistent(buf, counter)}
        for kind, fn in runs.items():
            buf[1:] = 0
            fn()
            torch.cuda.synchronize()
            assert torch.equal(buf, want), f"{kind} computed the wrong chain"
            us = graph_ms([fn], min_calls=8) * 1e3 / args.phases
            rows.append(dict(programs=programs, phases=args.phases, kind=kind, us_per_step=us))
            print(f"P={programs:4d} {kind:26s} {us:6.2f} us a step", flush=True)
    write_json(args.out, dict(run_info("barrier_probe"), rows=rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
