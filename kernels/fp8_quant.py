"""Per-row (per-token) float8 e4m3 quantization of activations, for the W8A8 FP8 projection.

engine/models/fp8.py's quantize_rows does it in torch: a float32 copy of the activations, abs,
amax, clamp, two divisions, a clamp and the cast: about eight kernels and several [M, K] float32
temporaries per projection. Here one program per row reads the row once, held in registers, or, for
a long row or one that fills its power-of-two block badly, twice in chunks (amax, then quantize;
the second read mostly from L2), and writes one byte per element and the row's scale. Rows fewer
than half the GPU's SMs (decode batches) are cut into chunks instead, one program each
(ROW_CHUNKS): each reads the whole row for its amax, mostly from L2, and quantizes its chunk only,
so the per-element arithmetic, which is what takes the time at a few rows, spreads over the GPU.

The result is bit-identical to the torch version on the same device: scale = max(amax|x_row|,
1e-12) / 448 in float32, q = round_to_e4m3(clamp(x / scale, ±448)). torch computes `/ 448` (a
division by a Python scalar) differently per device: on CUDA as a multiplication by the float32
reciprocal (1/448 rounded to float32; BinaryDivTrueKernel.cu's CPU-scalar optimisation), on the
CPU as a true division; the two differ in the last bit for about half the rows. The kernel does
what torch does on x's device (SCALE_BY_RECIPROCAL: CUDA tensors). x / scale is a true division in
both (a tensor divisor): tl.div_rn, IEEE round-to-nearest, since Triton's plain `/` on float32
compiles to the approximate div.full.f32 on NVIDIA. The rounding to e4m3 (nearest, ties to even,
subnormals included) is done in integer arithmetic on the float32 bits, as c10's
fp8_from_fp32_value does, rather than with `.to(tl.float8e4nv)`: the hardware conversion would
agree on sm_89+, but Triton's interpreter rounds float32 -> e4m3 wrongly (ties away from zero, no
carry from the mantissa into the exponent, subnormals not rounded), so the CPU tests could not
hold the kernel to torch's bits with it. The integer path gives the same bits on the GPU and in
the interpreter. Non-finite inputs are not matched bit for bit.

Launch parameters depend on shapes only (CUDA-graph capturable; no host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphserve.kernels.launch_settings import sm_count, use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
_TINY = 1e-12  # an all-zero row still gets a usable scale

_MAX_SINGLE_BLOCK = 8192  # rows up to this long may be loaded once and kept in registers
_CHUNKS = (4096, 2048, 1024)  # the two-pass path's chunk sizes
INV_FP8_MAX = float(torch.tensor(1.0) / FP8_MAX)  # 1/448 rounded to float32, as torch's CUDA division has it
# At most half as many rows as SMs: several programs a row, each quantizing one chunk
# (default_row_chunk). At 64 rows a step of Llama-3.1-8B FP8 spent 450 us of 4,051 in 64
# one-program-a-row launches (profile_decode-llama-3.1-8b-fp8-b64-h200-2026-12-02-fused-merge.json).
# H200 (decode_latency.py --fp8-quant-row-chunks on|off): 8B FP8 batch 64 15,477 against 14,929
# tok/s, batch 8 2,592 against 2,501. Alone (benchmarks/fp8_quant_bench.py), at 128 rows one
# program a row is faster (K 14336: 5.7 us against 7.4 for chunks of 4096), hence half the SMs;
# at 64 rows chunks of 2048 beat 4096 (4.3 against 5.2 us). So the chunks aim at about
# ROW_CHUNK_PROGRAMS_PER_SM = 4 programs an SM, not 2 (chunks of 2048 at 64 rows, not 4096): 8B FP8
# batch 64 15,746 / 15,788 against 15,366 / 15,393 tok/s, interleaved (decode_latency.py
# --fp8-quant-programs-per-sm 4|2, 8615439:benchmarks/results/decode_latency-h200-fp8-quant-programs-per-sm-ab-2026-12-02.json).
ROW_CHUNKS = True
ROW_CHUNK_PROGRAMS_PER_SM = 4
# Measured slower and removed (the code is at 0036f23): each chunk program loading its chunk before the amax
# pass and the row in one block of up to 16384 (two L2 round trips overlapped, in principle). 8B FP8 batch 64
# 16,760 / 16,734 against 16,882 / 17,001 tok/s, interleaved (decode_latency-h200-fp8-quant-loads-first-ab-
# 2026-12-03.json).
_MIN_ROW_CHUNK = 1024
_MAX_AMAX_BLOCK = 8192


class AmaxedRows(NamedTuple):
    """Activation rows [M, K] and the largest |value| of each of their parts as the kernel that wrote
    them saw it ([M, P] float32; the row's amax is the max over P), so that quantize_rows_fp8 need not
    read every row whole once more for it (kernels/skinny_gemm.py's row_amax)."""

    rows: torch.Tensor
    part_amax: torch.Tensor


@triton.jit
def _e4m3_bits(v):
    """float32 v with |v| <= 448 -> the e4m3fn byte (as int32) nearest to v, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal e4m3 (|v| >= 2^-6, float32 bits >= 121 << 23): round the 23-bit mantissa to 3 bits
    # (adding 0x7FFFF plus the lowest kept bit rounds half to even; a carry moves into the
    # exponent), then rebias the exponent from 127 to 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal e4m3 (multiples of 2^-9): adding 2^14, whose float32 ulp is 2^-9, rounds |v| to
    # that grid (float addition rounds to nearest even); the low bits are then the multiple (0..8)
    sub = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
    return tl.where(a < 0x3C800000, sub, normal) | sign


@triton.jit
def _row_scale(amax, inv_max, SCALE_BY_RECIPROCAL: tl.constexpr):
    """max(amax, 1e-12) / 448 in float32, rounded as torch rounds it on the tensor's device."""
    amax = tl.maximum(amax, 1e-12)
    if SCALE_BY_RECIPROCAL:
        return amax * inv_max
    else:
        return tl.div_rn(amax, 448.0)


@triton.jit
def quantize_row_values(x, inv_max, SCALE_BY_RECIPROCAL: tl.constexpr):
    """A whole row x (float32, padded with 0) -> (its e4m3 bytes as uint8, its scale): what
    quantize_rows_fp8 writes for it, bit for bit (kernels/rmsnorm.py's rms_norm_fp8 too)."""
    scale = _row_scale(tl.max(tl.abs(x), 0), inv_max, SCALE_BY_RECIPROCAL)
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    return _e4m3_bits(v).to(tl.uint8), scale


@triton.jit
def _quantize_rows_fp8_kernel(
    x_ptr, q_ptr, scale_ptr,
    K, stride_x, stride_q, inv_max,
    BLOCK_K: tl.constexpr,
    SINGLE_BLOCK: tl.constexpr,
    SCALE_BY_RECIPROCAL: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row per program. q_ptr: the e4m3 output viewed as uint8."""
    row = tl.program_id(0).to(tl.int64)
    if PDL:
        wait_for_previous_kernel()
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK_K)
    if SINGLE_BLOCK:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        values, scale = quantize_row_values(x, inv_max, SCALE_BY_RECIPROCAL)
        tl.store(q_row + offs, values, mask=mask)
    else:
        running = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(x))
        scale = _row_scale(tl.max(running, 0), inv_max, SCALE_BY_RECIPROCAL)
        for k0 in range(0, K, BLOCK_K):
            mask = k0 + offs < K
            x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
            tl.store(q_row + k0 + offs, _e4m3_bits(v).to(tl.uint8), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _quantize_row_chunks_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, part_amax_ptr,
    K, stride_x, stride_q, inv_max, parts,
    CHUNK: tl.constexpr,
    AMAX_BLOCK: tl.constexpr,
    SCALE_BY_RECIPROCAL: tl.constexpr,
    PDL: tl.constexpr,
    PART_AMAX: tl.constexpr,
):
    """Program (row, c): the whole row's amax, then chunk c of the row quantized; chunk 0 also
    writes the row's scale. The same amax and arithmetic as _quantize_rows_fp8_kernel: the same bits.
    PART_AMAX: the amax is the max of the row's `parts` entries of part_amax_ptr (AMAX_BLOCK >= parts)
    instead of a pass over the row."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if PDL:
        wait_for_previous_kernel()
    x_row = x_ptr + row * stride_x
    offs_a = tl.arange(0, AMAX_BLOCK)
    if PART_AMAX:
        running = tl.load(part_amax_ptr + row * parts + offs_a, mask=offs_a < parts, other=0.0)
    else:
        running = tl.zeros([AMAX_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, AMAX_BLOCK):
            x = tl.load(x_row + k0 + offs_a, mask=k0 + offs_a < K, other=0.0).to(tl.float32)
            running = tl.maximum(running, tl.abs(x))
    scale = _row_scale(tl.max(running, 0), inv_max, SCALE_BY_RECIPROCAL)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < K
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    tl.store(q_ptr + row * stride_q + offs, _e4m3_bits(v).to(tl.uint8), mask=mask)
    if chunk == 0:
        tl.store(scale_ptr + row, scale)


def default_row_chunk(rows: int, k: int, sms: int) -> int | None:
    """The chunk (a power of two, at least 1024) each program quantizes when `rows` are at most half
    the `sms`: enough chunks a row for about ROW_CHUNK_PROGRAMS_PER_SM programs an SM, or None (one
    program a row)."""
    if not ROW_CHUNKS or 2 * rows > sms or k < 2 * _MIN_ROW_CHUNK:
        return None
    chunks = min(k // _MIN_ROW_CHUNK, -(-ROW_CHUNK_PROGRAMS_PER_SM * sms // rows))
    return triton.next_power_of_2(-(-k // chunks))


def default_block_k(k: int) -> int:
    """The block for rows of k: the whole row (its next power of two, if <= 8192: one pass) or a
    chunk of 4096, 2048 or 1024 (two passes): the first of these, largest first, whose masked tail
    is at most k / 8, else the one with the smallest tail. On an H200 (bf16, CUDA graphs), a whole
    row of 4864 in a block of 8192 took 64 us at M=4096, chunks of 1024 34 us; 14336 in chunks of
    2048 80 us, of 4096 98 us; 28672 in chunks of 4096 152 us, of 2048 165 us."""
    whole = triton.next_power_of_2(k)
    candidates = ([whole] if whole <= _MAX_SINGLE_BLOCK else []) + [b for b in _CHUNKS if b < whole]

    def tail(b: int) -> int:
        return -(-k // b) * b - k

    return next((b for b in candidates if tail(b) <= k // 8), min(candidates, key=tail))


def quantize_rows_fp8(x: torch.Tensor | AmaxedRows, *, block_k: int | None = None,
                      row_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] (bf16, fp16 or fp32; rows may be strided, last dim contiguous) ->
    (q [M, K] float8_e4m3fn, contiguous; scale [M, 1] float32), one scale per row:
    x[m] ≈ q[m].float() * scale[m]. Bit-identical to quantize_rows_fp8_ref (and so to
    engine.models.fp8.quantize_rows) on the same device.

    block_k: a power of two; chunks of block_k, two passes (unless block_k covers K: one pass).
    row_chunk: a power of two; a program for each row_chunk of each row. Default: default_row_chunk
    (none where block_k is given), else default_block_k(K). x as AmaxedRows: the row chunks take each
    row's amax from its parts' (at 64 rows of 14336, 1.8 MB read a launch instead of 12.8); the other
    paths read the rows for it as before.
    """
    part_amax = None
    if isinstance(x, AmaxedRows):
        x, part_amax = x
        if part_amax.dim() != 2 or part_amax.shape[0] != x.shape[0] or part_amax.dtype != torch.float32 \
                or not part_amax.is_contiguous():
            raise ValueError(f"part_amax must be float32 [{x.shape[0]}, P], contiguous")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"expected x [M, K] with a contiguous last dim, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    for name, value in (("block_k", block_k), ("row_chunk", row_chunk)):
        if value is not None and (value < 1 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two, got {value}")
    rows, k = x.shape
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    if k == 0:
        raise ValueError("x has rows of length 0: no scale is defined")
    pdl = use_pdl(x.device, elementwise=True)
    if row_chunk is None and block_k is None:
        row_chunk = default_row_chunk(rows, k, sm_count(x.device))
    if row_chunk is not None:
        chunk = min(row_chunk, triton.next_power_of_2(k))
        parts = part_amax is not None
        _quantize_row_chunks_fp8_kernel[(rows, triton.cdiv(k, chunk))](
            x, q.view(torch.uint8), scale, part_amax if parts else scale,
            k, x.stride(0), q.stride(0), INV_FP8_MAX, part_amax.shape[1] if parts else 0,
            CHUNK=chunk,
            AMAX_BLOCK=(triton.next_power_of_2(part_amax.shape[1]) if parts
                        else min(_MAX_AMAX_BLOCK, triton.next_power_of_2(k))),
            SCALE_BY_RECIPROCAL=x.is_cuda,
            PDL=pdl,
            PART_AMAX=parts,
            num_warps=8,
            launch_pdl=pdl,
        )
        return q, scale
    block = default_block_k(k) if block_k is None else min(block_k, triton.next_power_of_2(k))
    _quantize_rows_fp8_kernel[(rows,)](
        x, q.view(torch.uint8), scale,
        k, x.stride(0), q.stride(0), INV_FP8_MAX,
        BLOCK_K=block,
        SINGLE_BLOCK=block >= k,
        SCALE_BY_RECIPROCAL=x.is_cuda,
        PDL=pdl,
        num_warps=min(16, max(1, block // 256)),
        launch_pdl=pdl,
    )
    return q, scale


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """graphserve.engine.models.fp8.quantize_rows: scale = max(amax|x_row|, 1e-12) / 448 in float32,
    q = (x / scale).clamp(±448) cast to e4m3. Its scale's last bit depends on the device (see the
    module docstring)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
