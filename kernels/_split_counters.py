"""Counters that let the last program of a split computation finish it, instead of a second kernel.

A kernel that splits one output over several programs (decode attention over the KV range) writes
float32 partials; each program then counts itself in on an int32 counter of its output, and the one
that completes the count reads every partial and writes the output. That saves a launch and, under
programmatic dependent launch, the wait for one grid to complete before the next starts. (The skinny
GEMM's split K summed the same way measured slower: kernels/skinny_gemm.py.)

The counters of one owner (a kernel) on one device and stream priority are a single zeroed buffer,
allocated once outside CUDA-graph capture (the warm-up run before a capture, on the capture's
stream priority, allocates them) and reset to 0 by the programs that use them, so they are 0 again
after every launch, eager or replayed. Launches that share them must run one after another. They
do: the engine launches on one stream per priority, decode rounds and eager work on default-priority
streams, the prefill graphs that overtake decode rounds on a high-priority one
(engine/runner/prefill_graphs.py), which may run beside a round and so get counters of their own; on one
stream, a kernel reads the counters only after its PDL wait, when the launch before it completed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MIN_COUNTERS = 1 << 16  # int32 counters allocated at once (256 KB), enough for any decode batch
_counters: dict[tuple[torch.device, str, int], torch.Tensor] = {}


def split_counters(device: torch.device, owner: str, n: int) -> torch.Tensor | None:
    """At least n zeroed int32 counters of `owner` on `device` for the current stream's priority, or
    None while a CUDA graph is being captured and none that many exist yet (allocated there, they
    would live in the graph's pool): the caller then finishes the split with a second kernel."""
    cuda = device.type == "cuda"
    key = (device, owner, torch.cuda.current_stream(device).priority if cuda else 0)
    counters = _counters.get(key)
    if counters is None or counters.numel() < n:
        if cuda and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(max(n, _MIN_COUNTERS), dtype=torch.int32, device=device)
        _counters[key] = counters
    return counters


@triton.jit
def last_to_arrive(counter_ptr, arrivals):
    """Count this program in on *counter_ptr after every one of its threads' stores, released at GPU
    scope. True in the last of `arrivals` programs: the others' stores are visible to it (read them
    through L2, cache_modifier=".cg", never a stale L1 line), and it leaves the counter at 0."""
    tl.debug_barrier()
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = done == arrivals - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
