"""The GPU-only code paths of our kernels compile for an H100/H200 (sm_90) on this CPU machine:
programmatic dependent launch of the kernels between the projections (kernels/_common.PDL_ELEMENTWISE),
the skinny GEMM's weight prefetch before its PDL wait (kernels/skinny_gemm.PREFETCH_BEFORE_WAIT), and
its rotary + KV-store epilogue on the tensor cores' layout (layers.SKINNY_ROPE_STORE), and decode
attention's KV prefetch before its wait (kernels/decode_attention.PREFETCH_TILES).
The interpreter never runs them, and CI has no GPU; Triton's own compiler and ptxas do, in a
process without TRITON_INTERPRET (tests/hopper_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).with_name("hopper_compile.py")


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(HELPER)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["rms_norm", "rms_norm_fp8", "rope_kv_store", "silu_and_mul", "quantize_rows_fp8",
                                    "skinny_bf16_prefetch", "skinny_bf16_silu_prefetch", "skinny_w8a8_silu_prefetch",
                                    "skinny_bf16_rope_prefetch", "skinny_w8a8_rope_prefetch", "skinny_bf16",
                                    "skinny_w8a8_silu", "attention_qwen_prefetch0", "attention_qwen_prefetch2",
                                    "attention_llama_prefetch2"])
def test_the_pdl_variant_compiles_and_waits_for_the_kernel_before(compiled, kernel):
    assert compiled[kernel]["waits"] >= 1
    first = compiled[kernel]["first_line"]
    assert first["griddepcontrol.wait"] < first["griddepcontrol.launch_dependents"]


@pytest.mark.parametrize("kernel,lines", [("skinny_bf16_prefetch", 64 * 4), ("skinny_bf16_silu_prefetch", 2 * 64 * 4),
                                          ("skinny_w8a8_silu_prefetch", 2 * 64 * 4),
                                          ("skinny_bf16_rope_prefetch", 2 * 64 * 4)])
def test_the_skinny_gemm_prefetches_its_weights_before_it_waits(compiled, kernel, lines):
    """64 weight rows (128 for gate and up, or the two halves of the heads) x 4 lines of 128 bytes, over
    128 threads, all before the wait; none as shipped."""
    assert compiled["skinny_bf16"]["prefetches"] == 0
    assert compiled[kernel]["prefetches"] == lines // 128
    assert compiled[kernel]["first_line"]["prefetch.global.L2"] < compiled[kernel]["first_line"]["griddepcontrol.wait"]


def test_the_grouped_fp8_gemv_holds_fewer_registers(compiled):
    """kernels/gemv.GROUPED_SUM: with the products summed in groups of 16 before the accumulator, the
    FP8 GEMV's down_proj tile needs well under the registers it needs without (more programs an SM)."""
    assert compiled["gemv_fp8_down_group16"]["registers"] < 0.75 * compiled["gemv_fp8_down_group1"]["registers"]


@pytest.mark.parametrize("model", ["qwen", "llama"])
def test_decode_attention_prefetches_its_first_kv_tiles_before_it_waits(compiled, model):
    """Two tiles of K and V rows (128 tokens of 128 bytes, or 64 of 256), one line a thread each: 4
    prefetches, all before the wait; none with PREFETCH_TILES 0."""
    assert compiled[f"attention_{model}_prefetch0"]["prefetches"] == 0
    kernel = compiled[f"attention_{model}_prefetch2"]
    assert kernel["prefetches"] == 2 * 2
    assert kernel["first_line"]["prefetch.global.L2"] < kernel["first_line"]["griddepcontrol.wait"]
