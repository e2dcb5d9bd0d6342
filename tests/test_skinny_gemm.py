"""graphserve.kernels.skinny_gemm: decode-batch projections on the tensor cores (float operands, W8A8 FP8, or
FP8 weights with bf16 activations)
against the float32 reference, with and without split K, bias, ragged edges. CPU tests run in
Triton's interpreter at small shapes (float32: its bf16 dot is not exact); the `gpu` ones at model
shapes on CUDA, against cuBLAS as well, and inside a captured CUDA graph."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from graphserve.kernels.skinny_gemm import (SHARED_MEMORY_BUDGET, SkinnyGemmTile, default_skinny_gemm_tile, skinny_gemm,
                                 skinny_gemm_ref, stage_bytes)
from tensor_checks import rel_err

skinny_module = importlib.import_module("graphserve.kernels.skinny_gemm")

FP8 = torch.float8_e4m3fn


def fp8_operands(m: int, n: int, k: int, device: str = "cpu", seed: int = 0, bias: bool = False):
    gen = torch.Generator(device=device).manual_seed(seed)
    xq = (torch.randn(m, k, generator=gen, device=device) * 40).clamp(-448, 448).to(FP8)
    wq = (torch.randn(n, k, generator=gen, device=device) * 40).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(m, 1, generator=gen, device=device) * 1e-2 + 1e-4
    w_scale = torch.rand(n, generator=gen, device=device) * 1e-3 + 1e-5
    b = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if bias else None
    return xq, x_scale, wq, w_scale, b


def float_operands(m: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                   bias: bool = False):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=device).to(dtype) if bias else None
    return x, w, b


def assert_close(out: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, sum_rel: float) -> None:
    """out within one rounding of its dtype of ref, plus sum_rel times the sum of the products'
    magnitudes (`magnitude`: |x| @ |w|.T), the bound of a sum whose adds round at that precision."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "an output the kernel never wrote"
    ulp = 2.0 ** -23 if out.dtype == torch.float32 else 2.0 ** -7
    bound = ref.float().abs() * ulp + magnitude * sum_rel + 1e-30
    excess = ((out.float() - ref.float()).abs() / bound).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the bound; relative error {rel_err(out, ref):.2e}"


def fp8_magnitude(xq, x_scale, wq, w_scale) -> torch.Tensor:
    return (xq.float().abs() * x_scale.reshape(-1, 1)) @ (wq.float().abs() * w_scale[:, None]).T


# (m, n, k, tile): one program column; ragged N / M / K edges; split K (exact and ragged)
CASES = [
    pytest.param(4, 32, 64, SkinnyGemmTile(16, 32, 16, 1, 4, 2), id="plain"),
    pytest.param(5, 40, 72, SkinnyGemmTile(16, 32, 16, 1, 4, 2), id="ragged-edges"),
    pytest.param(3, 32, 128, SkinnyGemmTile(16, 32, 16, 4, 4, 2), id="split-4"),
    pytest.param(18, 24, 100, SkinnyGemmTile(16, 32, 16, 3, 4, 2), id="split-ragged-two-row-blocks"),
]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_fp8_matches_ref(m, n, k, tile, bias, out_dtype, poisoned_outputs):
    xq, x_scale, wq, w_scale, b = fp8_operands(m, n, k, seed=m * n + k, bias=bias)
    out = skinny_gemm(xq, wq, b, x_scale=x_scale, weight_scale=w_scale, out_dtype=out_dtype, tile=tile)
    ref = skinny_gemm_ref(xq, wq, b, x_scale=x_scale, weight_scale=w_scale, out_dtype=out_dtype)
    assert_close(out, ref, fp8_magnitude(xq, x_scale, wq, w_scale), 2.0 ** -20)


@pytest.fixture(params=[False, True], ids=["pointers", "tma"])
def w8a8_tma(request, monkeypatch):
    """W8A8 through the pointer kernel or the copy-engine one at any row count
    (kernels.skinny_gemm.W8A8_TMA_MIN_ROWS, W8A8_TMA_SILU_MIN_ROWS)."""
    monkeypatch.setattr(skinny_module, "W8A8_TMA_MIN_ROWS", 1 if request.param else 0)
    monkeypatch.setattr(skinny_module, "W8A8_TMA_SILU_MIN_ROWS", 1 if request.param else 0)
    return request.param


# K a multiple of 16 bytes (the copy engine's row pitch) but not of the K tile; split K ragged
TMA_CASES = [
    pytest.param(5, 40, 80, SkinnyGemmTile(16, 32, 16, 1, 4, 2), id="ragged-edges"),
    pytest.param(18, 24, 144, SkinnyGemmTile(16, 32, 16, 3, 4, 2), id="split-ragged-two-row-blocks"),
    pytest.param(3, 32, 128, SkinnyGemmTile(16, 32, 16, 4, 4, 2), id="split-4"),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,tile", TMA_CASES)
def test_fp8_copy_engine_loads_match_ref(m, n, k, tile, bias, w8a8_tma, poisoned_outputs):
    """The TMA kernel (tiles past M and K arrive as zeros) computes what the pointer kernel does."""
    xq, x_scale, wq, w_scale, b = fp8_operands(m, n, k, seed=m * n + k + 1, bias=bias)
    assert skinny_module._tma_ready(xq, wq)
    out = skinny_gemm(xq, wq, b, x_scale=x_scale, weight_scale=w_scale, tile=tile)
    ref = skinny_gemm_ref(xq, wq, b, x_scale=x_scale, weight_scale=w_scale)
    assert_close(out, ref, fp8_magnitude(xq, x_scale, wq, w_scale), 2.0 ** -20)
    if tile.split > 1:  # the partials the norm after it sums
        pending = skinny_gemm(xq, wq, b, x_scale=x_scale, weight_scale=w_scale, tile=tile, defer_reduce=True)
        assert pending.partials.shape == (tile.split, m, n)
        assert torch.equal(skinny_module.finish_split(pending), out)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_float_matches_ref(m, n, k, tile, bias, poisoned_outputs):
    x, w, b = float_operands(m, n, k, torch.float32, seed=m + n + k, bias=bias)
    out = skinny_gemm(x, w, b, tile=tile)
    assert_close(out, skinny_gemm_ref(x, w, b), x.abs() @ w.abs().T, 2.0 ** -20)


def w_only_operands(m: int, n: int, k: int, device: str = "cpu", seed: int = 0, bias: bool = False):
    """bf16 activations (of a decoder's range, tiny values included) and an e4m3 weight with row scales."""
    _, _, wq, w_scale, b = fp8_operands(m, n, k, device, seed, bias)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    x = (torch.randn(m, k, generator=gen, device=device) * 3.0 ** torch.randint(-8, 4, (m, k), generator=gen,
                                                                               device=device)).to(torch.bfloat16)
    return x, wq, w_scale, b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_fp8_weight_only_matches_ref(m, n, k, tile, bias, poisoned_outputs):
    """bf16 x with an e4m3 weight: the weight exact in fp16, x scaled by 2^-8 into fp16 (exact for
    bf16 values from 2^-16 up), the products summed in float32."""
    x, wq, w_scale, b = w_only_operands(m, n, k, seed=m * n + k, bias=bias)
    out = skinny_gemm(x, wq, b, weight_scale=w_scale, out_dtype=torch.float32, tile=tile)
    ref = skinny_gemm_ref(x, wq, b, weight_scale=w_scale, out_dtype=torch.float32)
    assert_close(out, ref, x.float().abs() @ (wq.float().abs() * w_scale[:, None]).T, 2.0 ** -20)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("quant", [False, True], ids=["norm", "norm-fp8"])
def test_the_norm_after_a_split_projection_sums_its_partials_bit_for_bit(fp8, quant, poisoned_outputs):
    """defer_reduce: a product split over K comes back unsummed (SplitPartials), and the residual-add
    + RMSNorm kernel after it (or its FP8-quantizing variant) sums it itself: bit for bit the reduce
    kernel's product, then the norm; the product itself is skinny_gemm's without defer_reduce."""
    from graphserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm_fp8
    from graphserve.kernels.skinny_gemm import SplitPartials, finish_split

    m, n, k = 5, 64, 128
    tile = SkinnyGemmTile(16, 32, 16, 2, 4, 2)
    if fp8:
        xq, x_scale, wq, w_scale, b = fp8_operands(m, n, k, seed=3, bias=True)
        kw = dict(x_scale=x_scale, weight_scale=w_scale, out_dtype=torch.float32)
    else:
        xq, wq, b = float_operands(m, n, k, torch.float32, seed=3, bias=True)
        kw = {}
    pending = skinny_gemm(xq, wq, b, defer_reduce=True, tile=tile, **kw)
    assert isinstance(pending, SplitPartials) and pending.partials.shape == (2, m, n) and pending.shape == (m, n)
    summed = finish_split(pending)
    assert torch.equal(summed, skinny_gemm(xq, wq, b, tile=tile, **kw))
    residual = torch.randn(m, n, generator=torch.Generator().manual_seed(4))
    norm_weight = torch.rand(n, generator=torch.Generator().manual_seed(5)) + 0.5
    if quant:
        got = rms_norm_fp8(pending, norm_weight, 1e-6, residual)
        want = rms_norm_fp8(summed, norm_weight, 1e-6, residual)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    else:
        got, want = fused_add_rms_norm(pending, residual, norm_weight, 1e-6), \
            fused_add_rms_norm(summed, residual, norm_weight, 1e-6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="residual"):
        rms_norm_fp8(pending, norm_weight, 1e-6)
    # one split: nothing to defer, the product itself
    assert isinstance(skinny_gemm(xq, wq, b, defer_reduce=True, tile=tile._replace(split=1), **kw), torch.Tensor)


def test_split_results_do_not_depend_on_the_split_count():
    """Splitting K changes only the order of the float32 sums."""
    xq, x_scale, wq, w_scale, _ = fp8_operands(4, 32, 128, seed=7)
    run = lambda split: skinny_gemm(xq, wq, x_scale=x_scale, weight_scale=w_scale, out_dtype=torch.float32,  # noqa: E731
                                    tile=SkinnyGemmTile(16, 32, 16, split, 4, 2))
    one = run(1)
    for split in (2, 4):
        torch.testing.assert_close(run(split), one, rtol=1e-5, atol=1e-5 * one.abs().max().item())


def test_default_tile_splits_narrow_projections_only():
    sms = 132
    down = default_skinny_gemm_tile(64, 4096, 14336, sms)  # Llama-3.1-8B down_proj: 64 output tiles
    gate_up = default_skinny_gemm_tile(64, 28672, 4096, sms)  # 448 output tiles
    assert down.split > 1 and 14336 // down.split >= 1024
    assert gate_up.split == 1
    assert default_skinny_gemm_tile(8, 4096, 4096, sms).block_m == 16
    assert default_skinny_gemm_tile(64, 4096, 4096, sms).block_m == 64
    # the same tile bytes for bf16 weights as for weight-only FP8: half the K elements
    assert default_skinny_gemm_tile(8, 4096, 4096, sms, weight_bytes=2).block_k * 2 == \
        default_skinny_gemm_tile(8, 4096, 4096, sms, x_bytes=2).block_k


def test_default_tile_pipelines_w8a8_deeper_in_smaller_k_tiles():
    """W8A8 qkv / o / down (not gate_up's SiLU-and-mul): 128-byte K tiles 8 stages deep, within
    the shared-memory budget."""
    sms = 132
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        w8a8 = default_skinny_gemm_tile(64, n, k, sms)
        assert (w8a8.block_k, w8a8.num_stages) == (128, 8)
        assert w8a8.num_stages * stage_bytes(w8a8, 1) <= SHARED_MEMORY_BUDGET
        bf16 = default_skinny_gemm_tile(64, n, k, sms, weight_bytes=2)
        assert (bf16.block_k * 2, bf16.num_stages) == (256, 5)
    gate_up = default_skinny_gemm_tile(64, 14336, 4096, sms, silu_mul=True)
    assert (gate_up.block_k, gate_up.num_stages) == (128, 3)


def test_rejects_bad_operands():
    xq, x_scale, wq, w_scale, _ = fp8_operands(4, 32, 64)
    with pytest.raises(ValueError):
        skinny_gemm(xq.float(), wq, x_scale=x_scale, weight_scale=w_scale)  # dtypes differ
    with pytest.raises(ValueError):
        skinny_gemm(xq, wq[:, :32], x_scale=x_scale, weight_scale=w_scale)  # K differs
    with pytest.raises(ValueError):
        skinny_gemm(xq, wq, x_scale=x_scale[:2], weight_scale=w_scale)  # one scale per row
    with pytest.raises(ValueError):
        skinny_gemm(xq, wq)  # FP8 without scales
    with pytest.raises(ValueError):
        skinny_gemm(xq.float(), wq.float(), x_scale=x_scale, weight_scale=w_scale)  # scales without FP8
    x = xq.to(torch.bfloat16)
    with pytest.raises(ValueError):
        skinny_gemm(x, wq)  # a weight-only FP8 weight without its scales
    with pytest.raises(ValueError):
        skinny_gemm(x, wq, x_scale=x_scale, weight_scale=w_scale)  # weight-only takes no x scale
    with pytest.raises(ValueError):
        skinny_gemm(x.float(), wq, weight_scale=w_scale)  # weight-only needs bf16 / fp16 x


SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1152, 896), (896, 4864)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gpu_fp8_weight_only_model_shapes(m, n, k, poisoned_outputs):
    """The tensor cores' fp16 products are exact and their sums float32: within 2^-16 of the
    products' magnitudes, and no worse than cuBLAS on the dequantized bf16 weight."""
    x, wq, w_scale, b = w_only_operands(m, n, k, device="cuda", seed=m + n + k, bias=n == 1152)
    out = skinny_gemm(x, wq, b, weight_scale=w_scale)
    ref = skinny_gemm_ref(x, wq, b, weight_scale=w_scale)
    assert out.dtype == torch.bfloat16
    assert_close(out, ref, x.float().abs() @ (wq.float().abs() * w_scale[:, None]).T, 2.0 ** -16)
    cublas = F.linear(x, (wq.float() * w_scale[:, None]).to(torch.bfloat16), b)
    assert rel_err(out, ref) <= 2 * rel_err(cublas, ref) + 2.0 ** -16


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gpu_fp8_model_shapes(m, n, k, w8a8_tma, poisoned_outputs):
    """Hopper's FP8 dot adds at ~2^-13 within each 128-deep chunk (promoted to float32 between
    chunks): the bound allows 2^-11 of the products' magnitudes, and the error must not exceed
    twice cuBLAS's (torch._scaled_mm, exact accumulation) by more than that."""
    xq, x_scale, wq, w_scale, b = fp8_operands(m, n, k, device="cuda", seed=m + n + k, bias=n == 1152)
    out = skinny_gemm(xq, wq, b, x_scale=x_scale, weight_scale=w_scale)
    ref = skinny_gemm_ref(xq, wq, b, x_scale=x_scale, weight_scale=w_scale)
    assert_close(out, ref, fp8_magnitude(xq, x_scale, wq, w_scale), 2.0 ** -11)
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale[None, :], bias=b, out_dtype=torch.bfloat16)
    assert rel_err(out, ref) <= 2 * rel_err(cublas, ref) + 2.0 ** -11


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 64])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (896, 4864)], ids=["llama-o", "llama-down", "qwen-down"])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_norm_sums_split_partials_model_shapes(m, n, k, fp8, poisoned_outputs):
    """The o / down projection's split-K partials summed by the residual-add + RMSNorm after it (and
    its FP8-quantizing variant): bit for bit the reduce kernel's product, then the norm, at default
    tiles."""
    from graphserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm_fp8
    from graphserve.kernels.skinny_gemm import SplitPartials, finish_split

    if fp8:
        xq, x_scale, wq, w_scale, _ = fp8_operands(m, n, k, device="cuda", seed=m + k)
        kw = dict(x_scale=x_scale, weight_scale=w_scale)
    else:
        xq, wq, _ = float_operands(m, n, k, torch.bfloat16, device="cuda", seed=m + k)
        kw = {}
    pending = skinny_gemm(xq, wq, defer_reduce=True, **kw)
    assert isinstance(pending, SplitPartials)
    summed = finish_split(pending)
    assert torch.equal(summed, skinny_gemm(xq, wq, **kw))
    gen = torch.Generator(device="cuda").manual_seed(n)
    residual = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    norm_weight = (torch.rand(n, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    got, want = fused_add_rms_norm(pending, residual, norm_weight, 1e-5), fused_add_rms_norm(summed, residual,
                                                                                               norm_weight, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    got, want = rms_norm_fp8(pending, norm_weight, 1e-5, residual), rms_norm_fp8(summed, norm_weight, 1e-5, residual)
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16, 40, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gpu_bf16_model_shapes(m, n, k, poisoned_outputs):
    x, w, b = float_operands(m, n, k, torch.bfloat16, device="cuda", seed=m * k + n, bias=n == 1152)
    out = skinny_gemm(x, w, b)
    ref = skinny_gemm_ref(x, w, b)
    assert_close(out, ref, x.float().abs() @ w.float().abs().T, 2.0 ** -20)
    assert rel_err(out, ref) <= 2 * rel_err(F.linear(x, w, b), ref) + 2.0 ** -12


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
def test_gpu_graph_capture_replays_new_inputs(fp8, w8a8_tma):
    m, n, k = 64, 4096, 14336  # a split-K shape
    if fp8:
        xq, x_scale, wq, w_scale, _ = fp8_operands(m, n, k, device="cuda", seed=1)
        run = lambda: skinny_gemm(xq, wq, x_scale=x_scale, weight_scale=w_scale)  # noqa: E731
    else:
        xq, wq, _ = float_operands(m, n, k, torch.bfloat16, device="cuda", seed=1)
        x_scale = w_scale = None
        run = lambda: skinny_gemm(xq, wq)  # noqa: E731
    run()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    if fp8:
        fresh = fp8_operands(m, n, k, device="cuda", seed=2)
        xq.copy_(fresh[0])
        x_scale.copy_(fresh[1])
    else:
        xq.copy_(float_operands(m, n, k, torch.bfloat16, device="cuda", seed=2)[0])
    graph.replay()
    torch.cuda.synchronize()
    ref = skinny_gemm_ref(xq, wq, x_scale=x_scale, weight_scale=w_scale)
    magnitude = fp8_magnitude(xq, x_scale, wq, w_scale) if fp8 else xq.float().abs() @ wq.float().abs().T
    assert_close(out, ref, magnitude, 2.0 ** -11 if fp8 else 2.0 ** -20)


SILU_CASES = [pytest.param(3, 64, 64, SkinnyGemmTile(16, 32, 16, 1, 4, 2), id="plain"),
              pytest.param(5, 40, 72, SkinnyGemmTile(16, 32, 16, 4, 4, 2), id="ragged-split-ignored"),
              pytest.param(5, 40, 80, SkinnyGemmTile(16, 32, 16, 1, 4, 2), id="ragged-n-tma-pitch")]


@pytest.mark.parametrize("fp8", [False, True, "weight-only"])
@pytest.mark.parametrize("m,n,k,tile", SILU_CASES)
def test_silu_mul_matches_the_unfused_path(m, n, k, tile, fp8, w8a8_tma, poisoned_outputs):
    """silu(x @ gate.T) * (x @ up.T) for a fused [gate; up] weight, rounded like kernels/activation.py:
    within one output rounding of the reference (K is never split, whatever the tile says)."""
    if fp8 == "weight-only":
        xq, wq, w_scale, _ = w_only_operands(m, 2 * n, k, seed=m + k)
        kw = dict(weight_scale=w_scale, out_dtype=torch.float32)
    elif fp8:
        xq, x_scale, wq, w_scale, _ = fp8_operands(m, 2 * n, k, seed=m + k)
        kw = dict(x_scale=x_scale, weight_scale=w_scale, out_dtype=torch.float32)
    else:
        xq, wq, _ = float_operands(m, 2 * n, k, torch.float32, seed=m + k)
        kw = {}
    out = skinny_gemm(xq, wq, silu_mul=True, tile=tile, **kw)
    ref = skinny_gemm_ref(xq, wq, silu_mul=True, **kw)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(ValueError):
        skinny_gemm(xq, wq[:-1], silu_mul=True, **kw)  # an odd number of rows


def part_amax_of(out: torch.Tensor, block_n: int) -> torch.Tensor:
    """The largest |value| of each row's block_n-wide parts of out (the last part ragged)."""
    m, n = out.shape
    padded = torch.zeros(m, -(-n // block_n) * block_n, dtype=torch.float32)
    padded[:, :n] = out.float().abs()
    return padded.view(m, -1, block_n).amax(-1)


@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu-mul"])
@pytest.mark.parametrize("m,n,k,tile", [pytest.param(5, 40, 80, SkinnyGemmTile(16, 32, 16, 1, 4, 2), id="ragged"),
                                        pytest.param(18, 64, 48, SkinnyGemmTile(16, 32, 16, 1, 4, 2),
                                                     id="two-row-blocks")])
def test_row_amax_is_each_parts_largest_stored_value(m, n, k, tile, silu_mul, w8a8_tma, poisoned_outputs):
    """row_amax (layers.FP8_ROW_AMAX): the result as AmaxedRows, the same output and, per row, the
    largest |value| each program along N stored; the row quantization given them gives the bits it
    gives reading the rows. K split: no amax (the partials are not the output)."""
    from graphserve.kernels.fp8_quant import AmaxedRows, quantize_rows_fp8

    xq, x_scale, wq, w_scale, _ = fp8_operands(m, 2 * n if silu_mul else n, k, seed=m + n)
    kw = dict(x_scale=x_scale, weight_scale=w_scale, silu_mul=silu_mul, tile=tile)
    plain = skinny_gemm(xq, wq, **kw)
    got = skinny_gemm(xq, wq, row_amax=True, **kw)
    assert isinstance(got, AmaxedRows) and torch.equal(got.rows, plain)
    assert torch.equal(got.part_amax, part_amax_of(plain, tile.block_n))
    for chunk in (16, 32):
        want = quantize_rows_fp8(plain, row_chunk=chunk)
        values, scales = quantize_rows_fp8(got, row_chunk=chunk)
        assert torch.equal(values.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scales, want[1])
    if not silu_mul:
        assert not isinstance(skinny_gemm(xq, wq, row_amax=True, **dict(kw, tile=tile._replace(split=2))), AmaxedRows)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 33, 64])
def test_gpu_row_amax_model_shapes(m, w8a8_tma, poisoned_outputs):
    """Llama-3.1-8B's gate_up with SiLU-and-mul handing its rows' amax in parts (layers.FP8_ROW_AMAX):
    the same output, the parts' maxima of it, and down_proj's input quantized to the same bits."""
    from graphserve.kernels.fp8_quant import AmaxedRows, quantize_rows_fp8

    xq, x_scale, wq, w_scale, _ = fp8_operands(m, 28672, 4096, device="cuda", seed=m)
    kw = dict(x_scale=x_scale, weight_scale=w_scale, silu_mul=True)
    plain = skinny_gemm(xq, wq, **kw)
    got = skinny_gemm(xq, wq, row_amax=True, **kw)
    tile = default_skinny_gemm_tile(m, 14336, 4096, torch.cuda.get_device_properties(0).multi_processor_count,
                                    silu_mul=True)
    assert isinstance(got, AmaxedRows) and torch.equal(got.rows, plain)
    assert torch.equal(got.part_amax.cpu(), part_amax_of(plain.cpu(), tile.block_n))
    want = quantize_rows_fp8(plain)
    values, scales = quantize_rows_fp8(got)
    assert torch.equal(values.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scales, want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16, 40, 64])
@pytest.mark.parametrize("fp8", [False, True, "weight-only"])
def test_gpu_silu_mul_model_shapes(m, fp8, w8a8_tma, poisoned_outputs):
    n, k = 28672, 4096  # Llama-3.1-8B gate_up
    if fp8 == "weight-only":
        xq, wq, w_scale, _ = w_only_operands(m, n, k, device="cuda", seed=m)
        kw = dict(weight_scale=w_scale)
    elif fp8:
        xq, x_scale, wq, w_scale, _ = fp8_operands(m, n, k, device="cuda", seed=m)
        kw = dict(x_scale=x_scale, weight_scale=w_scale)
    else:
        xq, wq, _ = float_operands(m, n, k, torch.bfloat16, device="cuda", seed=m)
        kw = {}
    out = skinny_gemm(xq, wq, silu_mul=True, **kw)
    ref = skinny_gemm_ref(xq, wq, silu_mul=True, **kw)
    unfused = skinny_gemm_ref(xq, wq, **kw)  # the projection alone, then the activation kernel's rounding
    assert out.shape == (m, n // 2) and not out.isnan().any()
    assert rel_err(out, ref) <= 2.0 ** -7, rel_err(out, ref)
    from graphserve.kernels.activation import silu_and_mul

    assert rel_err(silu_and_mul(unfused), ref) <= 2.0 ** -7


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("weight_bytes,x_bytes", [(1, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("m", [2, 8, 16, 32, 64])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (1152, 896), (4864, 896),
                                 (896, 4864)])
def test_default_tiles_fit_in_shared_memory(n, k, m, weight_bytes, x_bytes, silu_mul):
    """Every default launch's pipeline fits the budget (a tile that does not fails only on a GPU)."""
    from graphserve.kernels.skinny_gemm import SHARED_MEMORY_BUDGET, stage_bytes

    tile = default_skinny_gemm_tile(m, n, k, 132, weight_bytes, silu_mul, x_bytes)
    assert tile.num_stages * stage_bytes(tile, weight_bytes, silu_mul, x_bytes) <= SHARED_MEMORY_BUDGET
    assert tile.num_stages >= 2 and (tile.split == 1 or not silu_mul)
