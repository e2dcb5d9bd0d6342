"""Triton GPU kernels; each module holds a kernel, its wrapper and a pure-torch `*_ref` beside it.

Importing this package imports triton. On a machine without CUDA, set TRITON_INTERPRET=1 before
the import to run the kernels in Triton's interpreter (slow; for tests).
"""

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    pick_num_splits,
)
from kernels.fp8_quant import quantize_rows_fp8, quantize_rows_fp8_ref
from kernels.gemv import GemvTile, default_gemv_tile, gemv, gemv_ref, gemv_rope_store, gemv_rope_store_ref
from kernels.host_wait import wait_for_host, wait_for_host_ref
from kernels.kv_store import store_kv, store_kv_ref
from kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
    prefill_tile_map,
)
from kernels.sampling import greedy_sample, greedy_sample_ref
from kernels.skinny_gemm import SkinnyGemmTile, skinny_gemm, skinny_gemm_ref
from kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from kernels.rope_kv_store import rope_and_store_kv, rope_and_store_kv_ref
from kernels.rotary import (
    apply_rotary,
    apply_rotary_ref,
    build_cos_sin_cache,
    rope_inv_freq,
)

__all__ = [
    "GemvTile",
    "SkinnyGemmTile",
    "apply_rotary",
    "apply_rotary_ref",
    "build_cos_sin_cache",
    "default_gemv_tile",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "gemv",
    "gemv_ref",
    "gemv_rope_store",
    "gemv_rope_store_ref",
    "greedy_sample",
    "greedy_sample_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "prefill_tile_map",
    "pick_num_splits",
    "quantize_rows_fp8",
    "quantize_rows_fp8_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope_and_store_kv",
    "rope_and_store_kv_ref",
    "rope_inv_freq",
    "silu_and_mul",
    "silu_and_mul_ref",
    "skinny_gemm",
    "skinny_gemm_ref",
    "store_kv",
    "wait_for_host",
    "wait_for_host_ref",
    "store_kv_ref",
]
