"""Ask L2 for a later kernel's weights while the kernels before it leave DRAM idle.

At decode with one row, the kernels between two projections (rotary + KV store, decode attention, a norm)
read little and wait on latency, so DRAM idles there; the projection after them then streams its weights
from cold. This kernel, launched between them, hands the TMA units bulk L2 prefetches of that projection's
weights (cp.async.bulk.prefetch.L2, sm_90+: one instruction a chunk, no registers, nothing waits for it),
so the weights are on their way, or in L2, when the projection reads them.

It writes nothing. With programmatic dependent launch it lets the kernel after it launch first, then issues
its prefetches, then waits for the kernel before it: the kernel after still waits on this one, which
completes only after the kernel before it did, so the order of every write is kept.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._common import use_pdl

CHUNK_BYTES = 16 << 10  # one bulk prefetch a lane (16 MiB: 32 programs)
LANES = 32  # one warp a program


@triton.jit
def _bulk_prefetch_l2(addresses, sizes):
    """One cp.async.bulk.prefetch.L2 a lane, of sizes[i] bytes (a multiple of 16, none if 0) from addresses[i]
    (16-byte aligned)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addresses, sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2_kernel(base_ptr, num_bytes, CHUNK: tl.constexpr, LANES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    start = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = tl.minimum(tl.maximum(num_bytes - start, 0), CHUNK).to(tl.int32)
    _bulk_prefetch_l2((base_ptr + start).to(tl.int64), size)
    if PDL:
        gdc_wait()


def prefetch_l2(weight: torch.Tensor, max_bytes: int) -> None:
    """Ask L2 for the first min(max_bytes, all) bytes of `weight` (contiguous, on an sm_90+ GPU), in stream
    order after the kernels already launched. A hint: it changes no value anywhere."""
    if not (weight.is_cuda and weight.is_contiguous()):
        raise ValueError("prefetch_l2 takes a contiguous CUDA tensor")
    if torch.cuda.get_device_capability(weight.device)[0] < 9:
        raise ValueError("prefetch_l2 needs sm_90 or later (cp.async.bulk)")
    num_bytes = min(max_bytes, weight.numel() * weight.element_size()) // 16 * 16
    if num_bytes <= 0:
        return
    pdl = use_pdl(weight.device)
    programs = triton.cdiv(num_bytes, CHUNK_BYTES * LANES)
    _prefetch_l2_kernel[(programs,)](weight.view(-1).view(torch.uint8), num_bytes, CHUNK=CHUNK_BYTES, LANES=LANES,
                                     PDL=pdl, num_warps=1, launch_pdl=pdl)
