"""The programmatic-dependent-launch handshake every PDL kernel makes (kernels/launch_settings.PDL): wait for the
kernel before it, and let the kernel after it launch.

A kernel reads before its wait only what no kernel still running can write: its weights, and (decode
attention) the step's context lengths, written by the step's first kernel, at least two launches before any
attention. A kernel two launches back has completed: kernel N+2 launches only once every program of N+1 has
passed its wait, which returns once N completed (whether or not the embedding lookup between them runs with
PDL, engine/models/layers.PDL_EMBEDDING).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# Off: the kernel after may launch once this kernel's programs have passed their wait (the kernel before
# finished). On: as soon as they start, so it takes SMs and reads its weights one kernel earlier (its own
# wait still orders it after this kernel). On was slower at batch 1: H200, interleaved
# (decode_latency.py --pdl-early-trigger on|off), Qwen2.5-0.5B 1,806-1,808 against 1,831-1,834 tok/s,
# Llama-3.1-8B FP8 324-329 against 355-356; batch 64 0.5B 62,985 / 62,831 against 63,647 / 63,396, 8B FP8
# within noise (8615439:benchmarks/results/decode_latency-h200-pdl-early-trigger-ab-2026-12-02.json).
EARLY_TRIGGER = tl.constexpr(False)


@triton.jit
def wait_for_previous_kernel():
    if EARLY_TRIGGER:
        gdc_launch_dependents()
        gdc_wait()
    else:
        gdc_wait()
        gdc_launch_dependents()
