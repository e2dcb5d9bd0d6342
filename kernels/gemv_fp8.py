"""FP8 matrix-vector products for one-row decode with bf16 activations, in packed bf16 pairs:
out = x @ (q * scale).T for x [M, K] bf16 and q [N, K] float8 e4m3 with a float32 scale per row.

kernels/gemv.py turns each e4m3 weight into a float32 with two ALU operations (a byte extract and a
mask) and a shift and a multiply-add on the FMA pipe. For the projections without a fused prologue
that leaves the kernel short of memory bandwidth (Llama-3.1-8B FP8 down_proj at one row: 72% of copy
bandwidth where the bf16 GEMV reaches 91%). Here the weights are read as 32-bit words of four, and
each word becomes two bf16 pairs with one byte permute and one mask (ALU) and two integer
multiply-adds (FMA pipe) a pair; one fma.rn.bf16x2 then multiplies a pair by the matching pair of x
and adds it to a running pair sum. The weights are exact in bf16 (q * 2^-120, e4m3 subnormals as
bf16 subnormals) and x, scaled by 2^64 to keep every product a normal number, is bf16 already; what
this path adds is one bf16 rounding a K tile to each running sum (K / BLOCK_K of them) before the
float32 sum across the tile, far under the FP8 weights' own error.

Launch parameters depend on shapes only (CUDA-graph capturable). Triton's interpreter has no inline
assembly and gets bf16 arithmetic wrong, so there (ASM off) the same roundings run in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._common import use_pdl

# Off: the FP8 one-row projections without a fused prologue take kernels/gemv.py's float32 path.
FP8_PACKED_BF16 = True
# bf16 bits of 2^64 in both halves of a word
_X_PRESCALE_PAIR = tl.constexpr(0x5F805F80)
_X_PRESCALE = tl.constexpr(2.0**64)
_Y_RESCALE = tl.constexpr(2.0**56)


@triton.jit
def _pair_lo(p):
    """The low bf16 of a pair word as float32."""
    return (p << 16).to(tl.float32, bitcast=True)


@triton.jit
def _pair_hi(p):
    return (p & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(f):
    """float32 (finite) rounded to the nearest bf16, ties to even: its bits in the low 16 of an int32.
    (The interpreter's own casts to bf16 truncate.)"""
    bits = f.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _pair(lo, hi):
    """Two float32 values rounded to bf16, as one pair word (lo in bits 0-15)."""
    return (_bf16_bits(hi) << 16) | _bf16_bits(lo)


@triton.jit
def _e4m3_f32(w, byte: tl.constexpr):
    """Byte `byte` of each word as float32 q * 2^-120 (the interpreter's path)."""
    b = (w << (24 - 8 * byte)) >> 24  # sign-extended
    return ((b << 20) & -2013265921).to(tl.float32, bitcast=True)  # 0x87FFFFFF


@triton.jit
def _prescale(x_pair, ASM: tl.constexpr):
    """A bf16 pair times 2^64 (exact)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [x_pair, _X_PRESCALE_PAIR],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return _pair(_pair_lo(x_pair) * _X_PRESCALE, _pair_hi(x_pair) * _X_PRESCALE)


@triton.jit
def _fma_e4m3_word(w, x01, x23, acc01, acc23, ASM: tl.constexpr):
    """acc01 += (weights 0, 1 of word w) * x01, acc23 += (weights 2, 3) * x23, in bf16 pairs rounded
    once each. ASM: bytes 0 and 1 spread to bytes 0 and 2 (prmt), times 16 puts exponent and
    mantissa in place, and adding sign * (2^15 - 2^11) moves the sign from bit 11 to bit 15 of its
    half."""
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, s0, s1;
            prmt.b32 t0, $2, 0, 0x4140;
            prmt.b32 t1, $2, 0, 0x4342;
            and.b32 s0, t0, 0x00800080;
            and.b32 s1, t1, 0x00800080;
            mul.lo.u32 t0, t0, 16;
            mul.lo.u32 t1, t1, 16;
            mad.lo.u32 t0, s0, 240, t0;
            mad.lo.u32 t1, s1, 240, t1;
            fma.rn.bf16x2 $0, t0, $3, $5;
            fma.rn.bf16x2 $1, t1, $4, $6;
            }""",
            "=r,=r,r,r,r,r,r", [w, x01, x23, acc01, acc23], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    lo01 = _e4m3_f32(w, 0) * _pair_lo(x01) + _pair_lo(acc01)
    hi01 = _e4m3_f32(w, 1) * _pair_hi(x01) + _pair_hi(acc01)
    lo23 = _e4m3_f32(w, 2) * _pair_lo(x23) + _pair_lo(acc23)
    hi23 = _e4m3_f32(w, 3) * _pair_hi(x23) + _pair_hi(acc23)
    return _pair(lo01, hi01), _pair(lo23, hi23)


@triton.jit
def _gemv_fp8_pairs_kernel(
    x_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    N, K_WORDS,
    stride_x_words, stride_w_words, stride_o,
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """x read as int64 words (four bf16), the weights (int8) as int32 words (four e4m3); BLOCK_W
    words of K a tile."""
    m = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = w_ptr.to(tl.pointer_type(tl.int32)) + offs_n.to(tl.int64)[:, None] * stride_w_words
    x_row = x_ptr.to(tl.pointer_type(tl.int64)) + m * stride_x_words

    # the weights do not depend on the kernel before: the first tile is read before the PDL wait,
    # every later one an iteration ahead of its use
    offs = tl.arange(0, BLOCK_W)
    w = tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & (offs < K_WORDS)[None, :], other=0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

    acc01 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)  # bf16 pairs of +0
    acc23 = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for k0 in range(0, K_WORDS, BLOCK_W):
        offs = k0 + tl.arange(0, BLOCK_W)
        xw = tl.load(x_row + offs, mask=offs < K_WORDS, other=0)
        x01 = _prescale(xw.to(tl.int32), ASM)
        x23 = _prescale((xw >> 32).to(tl.int32), ASM)
        acc01, acc23 = _fma_e4m3_word(w, x01[None, :], x23[None, :], acc01, acc23, ASM)
        next_offs = offs + BLOCK_W
        w = tl.load(w_rows + next_offs[None, :], mask=n_mask[:, None] & (next_offs < K_WORDS)[None, :], other=0)

    y = tl.sum(_pair_lo(acc01) + _pair_hi(acc01) + _pair_lo(acc23) + _pair_hi(acc23), 1)
    y *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0) * _Y_RESCALE
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_o + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def applies(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """Whether this kernel takes the projection: FP8 weights, bf16 x, K and the row strides whole
    words (x rows 8-byte aligned, weight rows 4-byte aligned)."""
    return (FP8_PACKED_BF16 and weight_scale is not None and x.dtype == torch.bfloat16 and x.shape[1] % 4 == 0
            and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0
            and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0)


def gemv_fp8_pairs(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                   out: torch.Tensor, block_n: int, block_k: int, num_warps: int) -> None:
    """out [M, N] = x @ (weight * weight_scale[:, None]).T (+ bias), rounded to out's dtype; the caller
    (kernels/gemv.py) checked the shapes and applies()."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows == 0:
        return
    pdl = use_pdl(x.device)
    _gemv_fp8_pairs_kernel[(rows, triton.cdiv(n, block_n))](
        x, weight.view(torch.int8), weight_scale, bias if bias is not None else out, out,
        n, k // 4,
        x.stride(0) // 4, weight.stride(0) // 4, out.stride(0),
        HAS_BIAS=bias is not None,
        PDL=pdl,
        ASM=x.is_cuda,
        BLOCK_N=block_n,
        BLOCK_W=max(1, block_k // 4),
        num_warps=num_warps,
        launch_pdl=pdl,
    )
