"""L2 prefetch from inside a Triton kernel. A kernel launched with PDL asks for the data that does not
depend on the kernel before it (weights, KV cache of earlier steps) before it waits, so DRAM latency
overlaps that kernel's tail. prefetch.global.L2 takes no registers, nothing waits for it, and it
leaves no copy in L1: a line the kernel before writes afterwards is read fresh from L2."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line holding each pointer (every pointer must be a valid address)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)
