"""Make the device stream wait for the host: one program spins on a counter in page-locked
host memory until the host has raised it to `expected`.

Why: a grammar-constrained row needs the host (its matcher) between two sampling steps,
but a decode round queues all its K steps at once. Queued between the forward pass and the
sampling of a step, this kernel holds the stream until the host has written the next
bitmask (and then the counter), while the forward pass itself already ran. CUDA events
cannot do this (a stream waits only on work queued before the wait), and a host callback
would need the GIL on a driver thread.

The spin is bounded: after `max_spins` reads it gives up and adds one to `timeouts` (host
memory too), so a host that died or stalled can never hang the device. Under UVA, page-locked
host memory (torch's pin_memory) is addressable from the device by its host pointer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DEFAULT_MAX_SPINS = 4_000_000  # each a read across PCIe (~0.5-1 us): a few seconds


@triton.jit(do_not_specialize=["expected"])  # one compiled kernel, whatever the count
def _wait_kernel(counter_ptr, timeouts_ptr, expected, max_spins):
    value = tl.load(counter_ptr, volatile=True)
    spins = 0
    while (value < expected) & (spins < max_spins):
        value = tl.load(counter_ptr, volatile=True)
        spins += 1
    if value < expected:
        tl.atomic_add(timeouts_ptr, 1, sem="relaxed", scope="sys")


def wait_for_host(counter: torch.Tensor, timeouts: torch.Tensor, expected: int,
                  max_spins: int = DEFAULT_MAX_SPINS) -> None:
    """Queue a wait on the current stream until counter[0] >= expected (int64, page-locked
    host memory on CUDA); `timeouts` (int32 [1], host memory too) counts the waits that gave up."""
    if counter.dtype != torch.int64 or timeouts.dtype != torch.int32:
        raise ValueError("counter must be int64 and timeouts int32")
    _wait_kernel[(1,)](counter, timeouts, expected, max_spins, num_warps=1)


def wait_for_host_ref(counter: torch.Tensor, timeouts: torch.Tensor, expected: int,
                      max_spins: int = DEFAULT_MAX_SPINS) -> None:
    """What the kernel does, on the host (no other thread can raise the counter meanwhile)."""
    if int(counter[0]) < expected:
        timeouts[0] += 1
