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

Then, with weights (--mlp, default on): Qwen2.5-0.5B's MLP at one row (no norm), as the engine runs it
(the GEMV with SiLU-and-mul over [gate; up], then the down GEMV: two PDL kernels) against one
persistent kernel (gate_up and SiLU, a grid barrier, down; each program asks L2 for its first down
tile before the barrier), both repeated in a CUDA graph, each layer with its own weights.

Measured on an H200 (barrier_probe-h200-2026-12-03.json): a PDL chain step 0.82-0.96 us against 1.15-1.86 for
the grid barrier; the persistent MLP 20.1 us a layer at its best against 10.1 for the two GEMVs. A grid barrier
costs more than the kernel boundary it would replace. Nor did splitting the MLP without a barrier pay (each program
a slice of the intermediate features and its share of down, float32 partials summed by the last programs to finish;
the code at b365b5a): 16-39 us a layer against 10.2 (split_mlp_probe-h200-2026-12-03.json).
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

from graphserve.kernels._pdl import wait_for_previous_kernel  # noqa: E402
from graphserve.kernels._prefetch import prefetch_l2  # noqa: E402


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
        grid_barrier(counter_ptr, (step + 1) * P)


@triton.jit
def grid_barrier(counter_ptr, target):
    """Count this program in (after every one of its threads' stores, released at GPU scope) and spin
    until `target` arrivals are in (acquire): the counter's arrivals so far, all programs resident."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _persistent_mlp_kernel(x_ptr, gate_up_ptr, down_ptr, act_ptr, out_ptr, counter_ptr, K, INTER, HIDDEN, num_programs,
                           PHASE: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr,
                           BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr):
    """One row: act = silu(x @ gate.T) * (x @ up.T) (rounded as kernels/gemv.py rounds), out = act @
    down.T, in one launch with a grid barrier between (PHASE 0) or as the first / second half alone
    (PHASE 1 / 2: the interpreter's way, which cannot pass a barrier). x [K] with K <= BLOCK_K1; each
    program takes every num_programs-th block of outputs."""
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    if PHASE != 2:
        offs_k = tl.arange(0, BLOCK_K1)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        for blk in range(pid, tl.cdiv(INTER, BLOCK_N1), num_programs):
            offs_n = blk * BLOCK_N1 + tl.arange(0, BLOCK_N1)
            mask = (offs_n < INTER)[:, None] & k_mask[None, :]
            rows = gate_up_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
            gate = tl.sum(tl.load(rows, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
            up = tl.sum(tl.load(rows + INTER * K, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
            gate = gate.to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
            tl.store(act_ptr + offs_n, act.to(dt), mask=offs_n < INTER)
    if PHASE == 0:
        # the first down tile does not depend on act: asked of L2 before the wait, as PDL kernels do
        lines = tl.arange(0, BLOCK_K2 // 64) * 64  # a 128-byte line of bf16 every 64 values
        first = pid * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        prefetch_l2(down_ptr + tl.minimum(first, HIDDEN - 1).to(tl.int64)[:, None] * INTER
                    + tl.minimum(lines, INTER - 1)[None, :])
        grid_barrier(counter_ptr, num_programs)
    if PHASE != 1:
        for blk in range(pid, tl.cdiv(HIDDEN, BLOCK_N2), num_programs):
            offs_n = blk * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            n_mask = offs_n < HIDDEN
            acc = tl.zeros([BLOCK_N2, BLOCK_K2], dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K2):
                offs = k0 + tl.arange(0, BLOCK_K2)
                a = tl.load(act_ptr + offs, mask=offs < INTER, other=0.0, cache_modifier=".cg").to(tl.float32)
                w = tl.load(down_ptr + offs_n.to(tl.int64)[:, None] * INTER + offs[None, :],
                            mask=n_mask[:, None] & (offs < INTER)[None, :], other=0.0)
                acc += w.to(tl.float32) * a[None, :]
            tl.store(out_ptr + offs_n, tl.sum(acc, 1).to(dt), mask=n_mask)


def persistent_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counter: torch.Tensor,
                   num_programs: int, fused: bool = True) -> torch.Tensor:
    """x [1, K], gate_up [2I, K], down [H, I] (contiguous) -> [1, H]: the MLP at one row in one
    persistent kernel (fused: needs CUDA, all num_programs programs resident; counter: an int32 at 0,
    left at num_programs), or its two halves as two launches."""
    inter, k = gate_up.shape[0] // 2, x.shape[1]
    hidden = down.shape[0]
    act = torch.empty(inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    args = (x, gate_up, down, act, out, counter, k, inter, hidden, num_programs)
    tiles = dict(BLOCK_N1=8, BLOCK_K1=triton.next_power_of_2(k), BLOCK_N2=4, BLOCK_K2=1024, num_warps=4)
    if fused:
        _persistent_mlp_kernel[(num_programs,)](*args, PHASE=0, **tiles)
    else:
        for phase in (1, 2):
            _persistent_mlp_kernel[(num_programs,)](*args, PHASE=phase, **tiles)
    return out


def mlp_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The engine's MLP at one row (kernels.gemv's reference: SiLU-and-mul, then down)."""
    from graphserve.kernels.gemv import gemv_ref

    act, _ = gemv_ref(x, gate_up, silu_mul=True)
    return gemv_ref(act, down)[0]


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


def mlp_rows(dev: torch.device, layers: int, hidden: int = 896, inter: int = 4864) -> list[dict]:
    """µs a layer of `layers` one-row MLPs (Qwen2.5-0.5B's shape, random weights a layer) in a CUDA graph:
    the persistent kernel with one and two programs an SM, then the engine's two GEMVs; each checked
    against the reference first."""
    from graphserve.kernels._common import sm_count
    from graphserve.kernels.gemv import gemv

    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(1, hidden, device=dev, generator=gen).to(torch.bfloat16)
    weights = [((torch.randn(2 * inter, hidden, device=dev, generator=gen) / hidden**0.5).to(torch.bfloat16),
                (torch.randn(hidden, inter, device=dev, generator=gen) / inter**0.5).to(torch.bfloat16))
               for _ in range(layers)]
    counters = torch.zeros(layers, dtype=torch.int32, device=dev)  # one a layer, zeroed once a replay

    def shipped():
        for gate_up, down in weights:
            gemv(gemv(x, gate_up, silu_mul=True)[0], down)

    rows = []
    want = mlp_ref(x, *weights[0])
    got = gemv(gemv(x, weights[0][0], silu_mul=True)[0], weights[0][1])[0]
    for per_sm in (1, 2):
        programs = per_sm * sm_count(dev)
        counters.zero_()
        out = persistent_mlp(x, *weights[0], counters[0], programs)
        torch.cuda.synchronize()
        assert ((out.float() - want.float()).norm() / want.float().norm()).item() < 1e-2, "persistent MLP is wrong"

        def persistent(programs=programs):
            counters.zero_()
            for layer, (gate_up, down) in enumerate(weights):
                persistent_mlp(x, gate_up, down, counters[layer], programs)

        us = graph_ms([persistent], min_calls=4) * 1e3 / layers
        rows.append(dict(kind=f"MLP, persistent, {programs} programs", layers=layers, us_per_mlp=us))
        print(f"MLP persistent ({programs} programs)  {us:6.2f} us a layer", flush=True)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    us = graph_ms([shipped], min_calls=4) * 1e3 / layers
    rows.append(dict(kind="MLP, two PDL GEMVs (shipped)", layers=layers, us_per_mlp=us))
    print(f"MLP shipped (two PDL GEMVs)      {us:6.2f} us a layer", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", nargs="+", type=int, default=[132, 528])
    p.add_argument("--phases", type=int, default=64)
    p.add_argument("--mlp", action=argparse.BooleanOptionalAction, default=True,
                   help="also Qwen2.5-0.5B's MLP at one row: two PDL GEMVs against one persistent kernel")
    p.add_argument("--layers", type=int, default=24, help="MLPs in a graph, each with its own weights")
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
    if args.mlp:
        rows += mlp_rows(dev, args.layers)
    write_json(args.out, dict(run_info("barrier_probe"), rows=rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
