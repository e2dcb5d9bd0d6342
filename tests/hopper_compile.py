"""Compile Triton kernels for an H100/H200 (sm_90) without a GPU, through Triton's own LLVM and
ptxas, and print what the PTX holds (JSON). Run as a script in a process without TRITON_INTERPRET
(tests/test_hopper_compile.py does): it checks code paths that only a GPU runs, PDL and prefetches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
FLOATS = {"eps", "inv_fp8_max", "inv_max", "scale_log2", "alpha", "limit"}


def signature(fn, constexprs: dict, pointers: dict[str, str]) -> dict[str, str]:
    """Every argument's type: constexprs as given, `pointers` as named, other *_ptr bf16, the rest i32 / fp32."""
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        if name in pointers:
            return pointers[name]
        if name.endswith("_ptr"):
            return "*bf16"
        return "fp32" if name in FLOATS else "i32"

    return {name: kind(name) for name in fn.arg_names}


def compile_kernel(fn, constexprs: dict, pointers: dict[str, str] | None = None, aligned: tuple[str, ...] = (),
                   **options):
    """The compiled kernel, specialised as a launch specialises it: every pointer 16-byte aligned, and
    the integers named in `aligned` multiples of 16."""
    sig = signature(fn, constexprs, pointers or {})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or name in aligned}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=HOPPER, options=options)
    assert kernel.asm["cubin"], "ptxas produced no cubin"
    return kernel


def compile_ptx(fn, constexprs: dict, pointers: dict[str, str] | None = None, **options):
    return compile_kernel(fn, constexprs, pointers, **options)


def registers(cubin: bytes) -> int:
    """Registers per thread, from Triton's own cuobjdump."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def summary(kernel) -> dict:
    # PTX lines, a guard predicate ("@%p1 ") dropped
    lines = [re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in kernel.asm["ptx"].splitlines()]
    keys = ("prefetch.global.L2", "griddepcontrol.wait", "griddepcontrol.launch_dependents", "bar.sync", "atom.",
            "ld.global.cg", "st.global")
    first = {key: next((i for i, line in enumerate(lines) if line.startswith(key)), None) for key in keys}
    last = {key: max((i for i, line in enumerate(lines) if line.startswith(key)), default=None) for key in keys}
    # an atom (or a red, Triton's atomic whose result goes unused)
    atomics = [i for i, line in enumerate(lines) if line.startswith(("atom.", "red.global"))]
    # a CTA barrier between the last global store and the first atomic after it (all threads' writes
    # happen before the one thread's release)
    stores = [i for i in range(atomics[0]) if lines[i].startswith("st.global")] if atomics else []
    barrier = bool(stores) and any(lines[i].startswith("bar.sync") for i in range(stores[-1], atomics[0]))
    return dict(prefetches=sum(line.startswith("prefetch.global.L2") for line in lines),
                tensor_core_ops=sum(line.startswith(("mma.", "wgmma.mma_async")) for line in lines),
                first_line=first, last_line=last,
                atomics=[lines[i].split()[0] for i in atomics if lines[i].startswith("atom.")],
                barrier_before_atomic=barrier,
                cg_loads=sum(line.startswith("ld.global.cg") for line in lines),
                acquire_loads=sum(line.startswith("ld.global.gpu.acquire") for line in lines),
                release_arrivals=sum(line.startswith(("atom.global.gpu.release.add", "red.global.gpu.release.add"))
                                     for line in lines),
                waits=sum(line.startswith("griddepcontrol.wait") for line in lines),
                registers=registers(kernel.asm["cubin"]))


def cases() -> dict[str, dict]:
    from graphserve.kernels.activation import _silu_and_mul_kernel
    from graphserve.kernels.fp8_quant import _quantize_row_chunks_fp8_kernel, _quantize_rows_fp8_kernel
    from graphserve.kernels.rmsnorm import _rms_norm_kernel
    from graphserve.kernels.rope_kv_store import _rope_kv_store_kernel
    from graphserve.kernels.skinny_gemm import _skinny_gemm_kernel

    out = {}
    skinny = dict(HAS_BIAS=False, HAS_SCALES=False, W_ONLY=False, SILU_MUL=False, SPLIT=1, PDL=True, DOT_PREC="tf32",
                  BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, IMPRECISE_K=128, ROW_AMAX=False)
    fp32_scales = {"x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "part_ptr": "*fp32", "amax_ptr": "*fp32"}
    # the skinny GEMM as shipped, bf16 and W8A8 with the SiLU: the paths every decode batch of 2-64 rows takes
    out["skinny_bf16"] = compile_ptx(_skinny_gemm_kernel, skinny, fp32_scales, num_warps=4, num_stages=5)
    out["skinny_w8a8_silu"] = compile_ptx(_skinny_gemm_kernel, dict(skinny, HAS_SCALES=True, SILU_MUL=True),
                                          dict(fp32_scales, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv"), num_warps=4,
                                          num_stages=3)
    # with each row's amax in parts for the quantization after it (engine/models/layers.FP8_ROW_AMAX)
    out["skinny_w8a8_silu_row_amax"] = compile_ptx(
        _skinny_gemm_kernel, dict(skinny, HAS_SCALES=True, SILU_MUL=True, ROW_AMAX=True),
        dict(fp32_scales, x_ptr="*fp8e4nv", w_ptr="*fp8e4nv"), num_warps=4, num_stages=3)
    norm = dict(HAS_RESIDUAL=True, BLOCK=1024, QUANT_FP8=False, SCALE_BY_RECIPROCAL=True, PDL=True, X_SPLIT=0,
                PART_W_SCALE=False, PART_X_SCALE=False, PART_BIAS=False)
    norm_ptrs = {"scale_ptr": "*fp32", "part_w_scale_ptr": "*fp32", "part_x_scale_ptr": "*fp32"}
    out["rms_norm"] = compile_ptx(_rms_norm_kernel, norm, norm_ptrs, num_warps=4)
    out["rms_norm_fp8"] = compile_ptx(_rms_norm_kernel, dict(norm, QUANT_FP8=True), dict(norm_ptrs, out_ptr="*u8"),
                                      num_warps=4)
    # summing the split-K partials of the projection before it (engine/models/layers.DEFER_SPLIT_REDUCE)
    out["rms_norm_split"] = compile_ptx(_rms_norm_kernel, dict(norm, X_SPLIT=2, BLOCK=4096),
                                        dict(norm_ptrs, x_ptr="*fp32"), num_warps=16)
    out["rms_norm_fp8_split"] = compile_ptx(
        _rms_norm_kernel, dict(norm, QUANT_FP8=True, X_SPLIT=2, BLOCK=4096, PART_W_SCALE=True, PART_X_SCALE=True),
        dict(norm_ptrs, x_ptr="*fp32", out_ptr="*u8"), num_warps=16)
    out["rope_kv_store"] = compile_ptx(_rope_kv_store_kernel, dict(NUM_Q_HEADS=14, Q_PAD=16, NUM_KV_HEADS=2, KV_PAD=2,
                                                                   HALF=32, PDL=True),
                                       {"pos_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32"}, num_warps=4)
    out["silu_and_mul"] = compile_ptx(_silu_and_mul_kernel, dict(BLOCK=1024, PDL=True), num_warps=4)
    out["quantize_rows_fp8"] = compile_ptx(_quantize_rows_fp8_kernel, dict(BLOCK_K=1024, SINGLE_BLOCK=True,
                                                                           SCALE_BY_RECIPROCAL=True, PDL=True),
                                           {"q_ptr": "*u8", "scale_ptr": "*fp32"}, num_warps=4)
    chunk_ptrs = {"q_ptr": "*u8", "scale_ptr": "*fp32", "part_amax_ptr": "*fp32"}
    out["quantize_row_chunks_fp8"] = compile_ptx(_quantize_row_chunks_fp8_kernel,
                                                 dict(CHUNK=4096, AMAX_BLOCK=8192, SCALE_BY_RECIPROCAL=True, PDL=True,
                                                      PART_AMAX=False), chunk_ptrs, num_warps=8)
    out["quantize_row_chunks_fp8_part_amax"] = compile_ptx(
        _quantize_row_chunks_fp8_kernel, dict(CHUNK=2048, AMAX_BLOCK=256, SCALE_BY_RECIPROCAL=True, PDL=True,
                                              PART_AMAX=True), chunk_ptrs, num_warps=8)
    from graphserve.kernels.embedding import _embedding_kernel

    out["embedding"] = compile_ptx(_embedding_kernel, dict(BLOCK=1024, PDL=True), {"ids_ptr": "*i64"}, num_warps=4)
    from graphserve.kernels.sampling import _argmax_partial_kernel

    # the row's last chunk merges (kernels/sampling.FUSED_MERGE), Qwen2.5-0.5B's vocabulary in chunks of 1024
    out["greedy_fused"] = compile_ptx(
        _argmax_partial_kernel, dict(CHUNK=1024, BLOCK=1024, MASKED=False, FUSED_MERGE=True, CHUNKS_PAD=256, PDL=True),
        {"part_max_ptr": "*fp32", "part_idx_ptr": "*i32", "part_sum_ptr": "*fp32", "part_lse_max_ptr": "*fp32",
         "counter_ptr": "*i32", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32", "bitmask_ptr": "*i32"}, num_warps=4)
    from graphserve.kernels.step_bookkeeping import _record_step_kernel, _step_inputs_kernel

    step_ptrs = {"step_ptr": "*i64", "positions_ptr": "*i64", "slots_ptr": "*i64", "context_lens_ptr": "*i32",
                 "pos_out_ptr": "*i64", "slot_out_ptr": "*i64", "ctx_out_ptr": "*i32", "tokens_ptr": "*i64",
                 "logprobs_ptr": "*fp32", "out_tokens_ptr": "*i64", "out_logprobs_ptr": "*fp32",
                 "input_ids_ptr": "*i64", "output_pos_ptr": "*i64"}
    out["step_inputs"] = compile_ptx(_step_inputs_kernel, dict(BLOCK=256, PDL=True), step_ptrs, num_warps=4)
    out["record_step"] = compile_ptx(_record_step_kernel, dict(BLOCK=256, PDL=True), step_ptrs, num_warps=4)
    from graphserve.kernels.gemv import _gemv_kernel

    gemv = dict(HAS_NORM=False, HAS_RESIDUAL=False, HAS_BIAS=False, HAS_W_SCALE=False, SILU_MUL=False, ROPE_STORE=False,
                Q_SIZE=0, KV_SIZE=0, HALF=1, PDL=True, K_CONST=0, BLOCK_N=1,
                BLOCK_K=1024)
    gemv_ptrs = {"w_scale_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32"}
    sizes = ("N", "K", "stride_x", "stride_r", "stride_ro", "stride_w", "stride_o")
    # bf16 down_proj's one-row tile: 1024-wide K as shipped, 2048 (kernels/gemv.LONG_K_BLOCK_K, to be measured)
    for block_k in (1024, 2048):
        out[f"gemv_down_k{block_k}"] = compile_kernel(_gemv_kernel, dict(gemv, BLOCK_K=block_k), gemv_ptrs, sizes,
                                                      num_warps=8)
    from graphserve.kernels.decode_attention import _decode_attention_kernel

    attention_ptrs = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_m_ptr": "*fp32",
                      "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32", "counter_ptr": "*i32", "amax_ptr": "*fp32"}
    strides = ("stride_qb", "stride_qh", "stride_cb", "stride_ct", "stride_bt", "stride_ob", "stride_oh")
    # Qwen2.5-0.5B's (7 q heads a KV head, D 64, 128-token tiles) and Llama-3.1-8B's (4, D 128, 64-token tiles)
    for name, group, head_dim, block_n, stages in (("qwen", 7, 64, 128, 2), ("llama", 4, 128, 64, 3)):
        attention = dict(NUM_KV_HEADS=2 if name == "qwen" else 8, GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim,
                         BLOCK_SIZE=16, BLOCK_N=block_n, WRITE_PARTIAL=True, DOT_PREC="tf32", PDL=True,
                         FUSED_MERGE=False, MERGE_GROUP=triton.next_power_of_2(group), MERGE_CHUNK=8,
                         ROW_AMAX=False)
        for tiles in (0, 2):
            out[f"attention_{name}_prefetch{tiles}"] = compile_kernel(
                _decode_attention_kernel, dict(attention, PREFETCH_TILES=tiles), attention_ptrs, strides,
                num_warps=4, num_stages=stages)
        # the last split to finish merges (kernels/decode_attention.FUSED_MERGE)
        out[f"attention_{name}_fused_merge"] = compile_kernel(
            _decode_attention_kernel, dict(attention, PREFETCH_TILES=2, FUSED_MERGE=True), attention_ptrs, strides,
            num_warps=4, num_stages=stages)
    # one split, each program's amax stored for o_proj's FP8 row quantization (layers.FP8_ATTENTION_AMAX)
    out["attention_llama_row_amax"] = compile_kernel(
        _decode_attention_kernel, dict(attention, PREFETCH_TILES=0, WRITE_PARTIAL=False, ROW_AMAX=True), attention_ptrs,
        strides, num_warps=4, num_stages=stages)
    # gpt-oss (issue 61): attention with each head's sink folded in where the splits merge, its window a constant
    out["attention_gpt_oss_sinks"] = compile_kernel(
        _decode_attention_kernel, dict(attention, NUM_KV_HEADS=8, GROUP=8, MERGE_GROUP=8, HEAD_DIM=64, BLOCK_N=128,
                                       PREFETCH_TILES=2, FUSED_MERGE=True, WINDOW=128, SINKS=True),
        attention_ptrs, strides, num_warps=4, num_stages=2)
    # its experts, MXFP4 as stored beside bf16 rows (tl.dot_scaled): the decode-sized block of 16 picks, aligned
    # (the grouped path) and not (the small-batch path: the expert ids in place of the aligned picks)
    from graphserve.kernels import gpt_oss_gemv
    from graphserve.kernels.gpt_oss_experts import _experts_gemm_kernel

    experts_ptrs = {"w_ptr": "*u8", "s_ptr": "*u8", "sorted_picks_ptr": "*i32", "block_experts_ptr": "*i32",
                    "num_padded_ptr": "*i32", "routing_ptr": "*fp32"}
    experts_sizes = ("N", "K", "stride_a", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be", "stride_o")
    for name, gate_up in (("gate_up", True), ("down", False)):
        for path, aligned in (("", True), ("_small", False)):
            ids = {} if aligned else {"sorted_picks_ptr": "*i64", "block_experts_ptr": "*i64", "num_padded_ptr": "*i64"}
            out[f"gpt_oss_mxfp4{path}_{name}"] = compile_kernel(
                _experts_gemm_kernel, dict(TOP_K=4, GATE_UP=gate_up, MXFP4=True, DOT_FORMAT="bf16", DOT_PREC="tf32",
                                           ALIGNED=aligned, PICKS_PAD=64, TOP_K_PAD=4, BLOCK_M=16, BLOCK_N=32,
                                           BLOCK_K=128), dict(experts_ptrs, **ids), experts_sizes,
                num_warps=4, num_stages=4)
    # at one or two tokens, the GEMV over int32 words of MXFP4 values (kernels/gpt_oss_gemv.py), its default tile
    gemv_ptrs = {"w_ptr": "*i32", "s_ptr": "*u8", "ids_ptr": "*i64", "routing_ptr": "*fp32"}
    gemv_sizes = ("N", "K", "stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_be", "stride_h",
                  "stride_o")
    for name, kernel in (("gate_up", gpt_oss_gemv._gate_up_kernel), ("down", gpt_oss_gemv._down_kernel)):
        out[f"gpt_oss_gemv_{name}"] = compile_kernel(kernel, dict(TOP_K=4, BLOCK_N=16, BLOCK_K=256, PDL=True),
                                                     gemv_ptrs, gemv_sizes, num_warps=4)
    return {name: summary(kernel) for name, kernel in out.items()}


if __name__ == "__main__":
    print(json.dumps(cases()))
