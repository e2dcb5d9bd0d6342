"""The GPU-only code paths of our kernels compile for an H100/H200 (sm_90) on this CPU machine:
programmatic dependent launch of the kernels between the projections (kernels/launch_settings.PDL_ELEMENTWISE)
and of the skinny GEMM, decode attention's KV prefetch before its wait
(kernels/decode_attention.PREFETCH_TILES), the last split finishing decode attention (FUSED_MERGE),
the GEMV's register use, and gpt-oss's sinks and MXFP4 experts (tensor-core paths and GEMV).
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


@pytest.mark.parametrize("kernel", ["rms_norm", "rms_norm_fp8", "rms_norm_split", "rms_norm_fp8_split", "rope_kv_store",
                                    "silu_and_mul", "quantize_rows_fp8", "quantize_row_chunks_fp8", "skinny_bf16", "skinny_w8a8_silu",
                                    "attention_qwen_prefetch0", "attention_qwen_prefetch2", "attention_llama_prefetch2",
                                    "attention_llama_row_amax",
                                    "step_inputs", "record_step", "greedy_fused",
                                    "embedding", "skinny_w8a8_silu_row_amax", "quantize_row_chunks_fp8_part_amax"])
def test_the_pdl_variant_compiles_and_waits_for_the_kernel_before(compiled, kernel):
    assert compiled[kernel]["waits"] >= 1
    first = compiled[kernel]["first_line"]
    assert first["griddepcontrol.wait"] < first["griddepcontrol.launch_dependents"]


def test_the_wider_down_proj_tile_takes_no_more_registers(compiled):
    """kernels/gemv.LONG_K_BLOCK_K: the one-row bf16 down_proj tile with 2048-wide K tiles holds twice
    the weight bytes in flight in no more registers than the 1024-wide one (as many programs an SM)."""
    assert compiled["gemv_down_k2048"]["registers"] <= compiled["gemv_down_k1024"]["registers"]


@pytest.mark.parametrize("model", ["qwen", "llama"])
def test_decode_attention_prefetches_its_first_kv_tiles_before_it_waits(compiled, model):
    """Two tiles of K and V rows (128 tokens of 128 bytes, or 64 of 256), one line a thread each: 4
    prefetches, all before the wait; none with PREFETCH_TILES 0."""
    assert compiled[f"attention_{model}_prefetch0"]["prefetches"] == 0
    kernel = compiled[f"attention_{model}_prefetch2"]
    assert kernel["prefetches"] == 2 * 2
    assert kernel["first_line"]["prefetch.global.L2"] < kernel["first_line"]["griddepcontrol.wait"]


@pytest.mark.parametrize("fused,unfused", [("attention_qwen_fused_merge", "attention_qwen_prefetch2"),
                                           ("attention_llama_fused_merge", "attention_llama_prefetch2")])
def test_the_last_split_finishes_after_a_release(compiled, fused, unfused):
    """kernels/_split_counters.last_to_arrive, in decode attention (FUSED_MERGE): every thread's partial
    is stored before a CTA barrier, one acquire-release atomic at GPU scope counts the split done,
    after the PDL wait, and the last split reads the others' partials through L2 (ld.global.cg),
    never L1. The unfused kernel has no atomic."""
    assert compiled[unfused]["atomics"] == [] and compiled[unfused]["cg_loads"] == 0
    kernel = compiled[fused]
    assert kernel["atomics"] == ["atom.global.gpu.acq_rel.add.u32"]
    assert kernel["barrier_before_atomic"]
    assert kernel["cg_loads"] > 0
    assert kernel["first_line"]["atom."] < kernel["first_line"]["ld.global.cg"]
    assert kernel["first_line"]["griddepcontrol.wait"] < kernel["first_line"]["atom."]


def test_the_last_chunk_of_a_row_picks_its_token_after_a_release(compiled):
    """kernels/sampling.FUSED_MERGE: every thread's partial stored before a CTA barrier, one
    acquire-release count at GPU scope after the PDL wait, the others' partials read through L2."""
    kernel = compiled["greedy_fused"]
    assert kernel["atomics"] == ["atom.global.gpu.acq_rel.add.u32"]
    assert kernel["barrier_before_atomic"] and kernel["cg_loads"] > 0
    first = kernel["first_line"]
    assert first["griddepcontrol.wait"] < first["atom."] < first["ld.global.cg"]


def test_record_step_advances_the_step_after_every_thread_read_it(compiled):
    """kernels/step_bookkeeping._record_step_kernel: the step counter is the last store, after a CTA barrier
    (a warp still to read the old step must not see the new one)."""
    kernel = compiled["record_step"]
    assert kernel["last_line"]["bar.sync"] < kernel["last_line"]["st.global"]


@pytest.mark.parametrize("kernel", ["gpt_oss_mxfp4_gate_up", "gpt_oss_mxfp4_down", "gpt_oss_mxfp4_small_gate_up",
                                    "gpt_oss_mxfp4_small_down"])
def test_the_mxfp4_experts_run_on_the_tensor_cores_without_spilling(compiled, kernel):
    """kernels/gpt_oss_experts.py's MXFP4 tiles beside bf16 rows (tl.dot_scaled, upcast in registers) at the
    decode block of 16 picks, the grouped and the small-batch paths: tensor-core products, and no more registers
    than a thread may hold."""
    assert compiled[kernel]["tensor_core_ops"] > 0 and compiled[kernel]["registers"] < 255


@pytest.mark.parametrize("kernel", ["gpt_oss_gemv_gate_up", "gpt_oss_gemv_down"])
def test_the_mxfp4_gemv_decodes_on_the_cuda_cores_with_few_registers(compiled, kernel):
    """kernels/gpt_oss_gemv.py at its default tile: no tensor-core op, the PDL wait, and at most 128 registers a
    thread (four programs of 4 warps an SM fit beside each other: its bandwidth needs them in flight)."""
    assert compiled[kernel]["tensor_core_ops"] == 0 and compiled[kernel]["waits"] == 1
    assert compiled[kernel]["registers"] <= 128


def test_decode_attention_with_sinks_compiles(compiled):
    """gpt-oss's sinks (SINKS) in the kernel whose last split merges, its sliding window (WINDOW 128) a constant."""
    kernel = compiled["attention_gpt_oss_sinks"]
    assert kernel["atomics"] == ["atom.global.gpu.acq_rel.add.u32"] and kernel["tensor_core_ops"] > 0
