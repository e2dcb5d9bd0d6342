"""graphserve.kernels.fp8_quant: per-row e4m3 quantization, bit for bit against the torch reference
(engine/models/fp8.py's quantize_rows). CPU tests run in Triton's interpreter at small shapes;
the `gpu` ones at model shapes on CUDA."""

from __future__ import annotations

import importlib

import pytest
import torch

from graphserve.kernels.fp8_quant import quantize_rows_fp8, quantize_rows_fp8_ref

FP8 = torch.float8_e4m3fn
# (K, block_k, row_chunk): K=100 in one block (128 wide, masked tail); block_k=32: four chunks, the
# last one partial; K=64 with block_k=16: chunks that tile the row exactly; the same two with a
# program per chunk (row_chunk)
PATHS = [pytest.param(100, 128, None, id="one-block"), pytest.param(100, 32, None, id="chunks-tail"),
         pytest.param(64, 16, None, id="chunks-exact"), pytest.param(100, None, 32, id="row-chunks-tail"),
         pytest.param(64, None, 16, id="row-chunks-exact")]


def assert_same(x: torch.Tensor, block_k: int | None = None,
                row_chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = quantize_rows_fp8(x, block_k=block_k, row_chunk=row_chunk)
    q_ref, scale_ref = quantize_rows_fp8_ref(x)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale.view(torch.int32), scale_ref.view(torch.int32)), (scale, scale_ref)
    bad = q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} bytes differ, e.g. x={x[bad][:5].tolist()} "
                           f"q={q[bad][:5].float().tolist()} ref={q_ref[bad][:5].float().tolist()}")
    return q, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("k,block_k,row_chunk", PATHS)
def test_matches_ref(dtype, k, block_k, row_chunk, poisoned_outputs):
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(5, k, generator=gen) * 3).to(dtype)
    assert_same(x, block_k, row_chunk)


def test_row_chunks_read_the_whole_row_for_the_amax(monkeypatch, poisoned_outputs):
    """A program per chunk, the amax read in pieces smaller than the row: each chunk's scale is its
    row's, wherever in the row the largest value is."""
    monkeypatch.setattr(importlib.import_module("graphserve.kernels.fp8_quant"), "_MAX_AMAX_BLOCK", 32)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 100, generator=gen, dtype=torch.bfloat16)
    for row, col in enumerate((3, 40, 70, 99)):  # the amax in each chunk of 32 in turn, the last partial
        x[row, col] = 50.0
    assert_same(x, row_chunk=32)


def test_default_row_chunk(monkeypatch):
    """With ROW_CHUNKS: up to half as many rows as SMs get chunks of at least 1024, about four
    programs an SM (Llama-3.1-8B's down_proj input at 64 rows: 7 chunks of 2048); more rows, one
    program each."""
    module = importlib.import_module("graphserve.kernels.fp8_quant")
    monkeypatch.setattr(module, "ROW_CHUNKS", True)
    monkeypatch.setattr(module, "ROW_CHUNK_PROGRAMS_PER_SM", 4)
    assert module.default_row_chunk(64, 14336, 132) == 2048
    assert module.default_row_chunk(64, 4096, 132) == 1024
    assert module.default_row_chunk(8, 14336, 132) == 1024
    assert module.default_row_chunk(40, 14336, 132) == 1024
    assert module.default_row_chunk(41, 14336, 132) == 2048
    assert module.default_row_chunk(66, 14336, 132) == 2048
    assert module.default_row_chunk(67, 14336, 132) is None
    assert module.default_row_chunk(128, 14336, 132) is None
    assert module.default_row_chunk(8, 1536, 132) is None  # too short to cut
    for rows in (1, 2, 8, 16, 64, 66):
        for k in (896, 2048, 4096, 4864, 14336, 28672):
            chunk = module.default_row_chunk(rows, k, 132)
            if chunk is not None:
                assert chunk >= 1024 and chunk & (chunk - 1) == 0 and -(-k // chunk) >= 2
    monkeypatch.setattr(module, "ROW_CHUNK_PROGRAMS_PER_SM", 2)  # half as many programs: twice the chunk
    assert module.default_row_chunk(64, 14336, 132) == 4096
    monkeypatch.setattr(module, "ROW_CHUNKS", False)
    assert module.default_row_chunk(64, 14336, 132) is None


@pytest.mark.parametrize("k,block_k,row_chunk", PATHS)
def test_strided_rows(k, block_k, row_chunk, poisoned_outputs):
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(6, k + 37, generator=gen, dtype=torch.bfloat16)
    x = big[:, 5:5 + k]  # row stride k + 37, offset start
    assert x.stride() == (k + 37, 1)
    assert_same(x, block_k, row_chunk)


@pytest.mark.parametrize("k,block_k,row_chunk", PATHS)
def test_zero_row_and_magnitudes(k, block_k, row_chunk, poisoned_outputs):
    gen = torch.Generator().manual_seed(2)
    mags = torch.tensor([1e-3, 1e-2, 1.0, 1e2, 1e3, 1.0])[:, None]
    x = (torch.randn(6, k, generator=gen) * mags).to(torch.bfloat16)
    x[5] = 0
    q, scale = assert_same(x, block_k, row_chunk)
    assert scale[5].item() == (torch.tensor(1e-12, dtype=torch.float32) / 448).item()  # float32 division
    assert torch.equal(q[5].view(torch.uint8), torch.zeros(k, dtype=torch.uint8))
    # the scale follows each row's amax: dequantized rows are close to x at every magnitude
    deq = q.float() * scale
    for m in range(5):
        err = (deq[m] - x[m].float()).abs().max() / x[m].float().abs().max()
        assert err < 0.05, (m, err)  # half an e4m3 ulp at the top binade: 16 / 448


@pytest.mark.parametrize("block_k,row_chunk", [(None, None), (256, None), (None, 256)])
def test_rounding_to_e4m3(block_k, row_chunk):
    """A row whose amax is 448 has scale 1, so q = round_e4m3(x): every finite e4m3 magnitude, every
    midpoint between neighbours (ties: to even), the float32 values either side of each midpoint,
    subnormals and values below the smallest one, both signs."""
    vals = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448
    mids = (vals[:-1] + vals[1:]) / 2
    above = torch.nextafter(mids, torch.full_like(mids, 1e9))
    below = torch.nextafter(mids, torch.full_like(mids, -1e9))
    tiny = torch.tensor([2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30, 1e-40, 0.0])
    row = torch.cat([vals, mids, above, below, tiny])
    x = torch.cat([row, -row])[None, :]
    q, scale = assert_same(x, block_k, row_chunk)
    assert scale.item() == 1.0
    assert torch.equal(q[0, :127].view(torch.uint8), torch.arange(0, 0x7F, dtype=torch.uint8))


@pytest.mark.parametrize("k,block_k,row_chunk", PATHS)
def test_cuda_scale_rounding_in_interpreter(k, block_k, row_chunk):
    """The CUDA scale (amax times 1/448 rounded to float32, as torch's CUDA division by a Python
    scalar computes it), run in the interpreter by launching the kernel with that flag."""
    from graphserve.kernels.fp8_quant import INV_FP8_MAX, _quantize_row_chunks_fp8_kernel, _quantize_rows_fp8_kernel

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, k, generator=gen, dtype=torch.bfloat16) * 3
    q = torch.full(x.shape, 0x7F, dtype=torch.uint8)  # NaN bytes
    scale = torch.full((64, 1), float("nan"))
    if row_chunk:
        _quantize_row_chunks_fp8_kernel[(64, -(-k // row_chunk))](
            x, q, scale, scale, k, x.stride(0), q.stride(0), INV_FP8_MAX, 0, CHUNK=row_chunk, AMAX_BLOCK=128,
            SCALE_BY_RECIPROCAL=True, PDL=False, PART_AMAX=False)
    else:
        _quantize_rows_fp8_kernel[(64,)](x, q, scale, k, x.stride(0), q.stride(0), INV_FP8_MAX, BLOCK_K=block_k,
                                         SINGLE_BLOCK=block_k >= k, SCALE_BY_RECIPROCAL=True, PDL=False)
    xf = x.float()
    scale_ref = xf.abs().amax(-1, keepdim=True).clamp(min=1e-12) * torch.tensor(1.0 / 448, dtype=torch.float32)
    assert not torch.equal(scale_ref, quantize_rows_fp8_ref(x)[1])  # the two roundings do differ here
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, (xf / scale_ref).clamp(-448, 448).to(FP8).view(torch.uint8))


def test_default_block_k():
    from graphserve.kernels.fp8_quant import default_block_k

    for k in [1, 3, 100, 896, 1100, 3584, 4096, 4864, 8192, 8193, 14336, 18944, 28672]:
        b = default_block_k(k)
        assert b & (b - 1) == 0 and 1 <= b <= 8192, (k, b)
        assert b >= k or b >= 1024, (k, b)  # one pass over the row, or chunks of at least 1024
    # rows that fill a power of two well take one pass; 4864 (Qwen2.5-0.5B's MLP) and rows past 8192 two
    assert [default_block_k(k) for k in (896, 4096, 4864, 14336, 28672)] == [1024, 4096, 1024, 2048, 4096]


def test_no_rows():
    x = torch.randn(0, 48, dtype=torch.bfloat16)
    q, scale = quantize_rows_fp8(x)
    assert q.shape == (0, 48) and q.dtype == FP8 and scale.shape == (0, 1) and scale.dtype == torch.float32


def test_rejects_bad_inputs():
    with pytest.raises(ValueError):
        quantize_rows_fp8(torch.randn(4, 8).t())  # last dim not contiguous
    with pytest.raises(ValueError):
        quantize_rows_fp8(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError):
        quantize_rows_fp8(torch.randn(4, 8), block_k=24)
    with pytest.raises(ValueError):
        quantize_rows_fp8(torch.randn(4, 8), row_chunk=12)
    from graphserve.kernels.fp8_quant import AmaxedRows

    for part_amax in (torch.ones(3, 2), torch.ones(4, 2, dtype=torch.float64), torch.ones(2, 4).t()):
        with pytest.raises(ValueError):
            quantize_rows_fp8(AmaxedRows(torch.randn(4, 8), part_amax))


def test_rows_with_their_amax_in_parts_quantize_to_the_same_bits(poisoned_outputs):
    """AmaxedRows (a producer's amax of each row's parts): the row chunks read those instead of the row;
    the paths that read whole rows anyway (one program a row) read the rows. The same bits either way."""
    from graphserve.kernels.fp8_quant import AmaxedRows

    gen = torch.Generator().manual_seed(8)
    x = (torch.randn(5, 96, generator=gen) * 3).to(torch.bfloat16)
    x[2, 90] = 40.0  # the row's amax in its last part
    parts = x.float().abs().view(5, 3, 32).amax(-1)
    for kw in (dict(row_chunk=32), dict(row_chunk=64), dict(block_k=32), {}):
        want = quantize_rows_fp8(x, **kw)
        got = quantize_rows_fp8(AmaxedRows(x, parts), **kw)
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(got[1], want[1])
        # which path read the parts: twice the parts, twice the scale (a power of two: exact)
        doubled = quantize_rows_fp8(AmaxedRows(x, parts * 2), **kw)[1]
        assert torch.equal(doubled, want[1] * (2 if "row_chunk" in kw else 1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [896, 4096, 4864, 14336])
@pytest.mark.parametrize("m", [1, 7, 64, 256])
def test_gpu_model_shapes(m, k, dtype, poisoned_outputs):
    gen = torch.Generator(device="cuda").manual_seed(m * k)
    mags = 10.0 ** torch.empty(m, 1, device="cuda").uniform_(-3, 3, generator=gen)
    x = (torch.randn(m, k, device="cuda", generator=gen) * mags).to(dtype)
    x[0, : k // 2] = 0  # amax from the second half only
    if m > 1:
        x[-1] = 0  # an all-zero row
    assert_same(x)
    if k > 1024:  # the two-pass path at a shape that would otherwise fit one block
        assert_same(x, block_k=1024)
    for chunk in (1024, 4096):  # a program per chunk (ROW_CHUNKS' path), whatever the default
        assert_same(x, row_chunk=chunk)


@pytest.mark.gpu
def test_gpu_strided_and_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(3)
    big = torch.randn(64, 3 * 4864, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = big[:, 4864:2 * 4864]
    assert_same(x)
    static = torch.zeros(64, 14336, device="cuda", dtype=torch.bfloat16)
    quantize_rows_fp8(static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = quantize_rows_fp8(static)
    static.copy_(torch.randn(64, 14336, device="cuda", generator=gen) * 5)
    graph.replay()
    torch.cuda.synchronize()
    q_ref, scale_ref = quantize_rows_fp8_ref(static)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


# ----------------------------------------------------------------------------- the norm, quantized

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("residual", [False, True], ids=["norm", "add-norm"])
def test_rms_norm_fp8_is_the_norm_then_the_quantization(dtype, residual, poisoned_outputs):
    """graphserve.kernels.rmsnorm.rms_norm_fp8: bit for bit rms_norm (or the residual add + rms_norm) in x's
    dtype followed by quantize_rows_fp8, and the same new residual; widths that fill their block
    and widths that do not; rows scaled far apart (their scales differ by 1e6)."""
    from graphserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm, rms_norm_fp8

    for hidden in (64, 100):
        gen = torch.Generator().manual_seed(hidden)
        x = (torch.randn(6, hidden, generator=gen) * torch.logspace(-3, 3, 6)[:, None]).to(dtype)
        res = (torch.randn(6, hidden, generator=gen) * 2).to(dtype) if residual else None
        w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        q, scale, new_res = rms_norm_fp8(x, w, 1e-6, res)
        normed, want_res = fused_add_rms_norm(x, res, w, 1e-6) if residual else (rms_norm(x, w, 1e-6), None)
        q_want, scale_want = quantize_rows_fp8(normed)
        assert q.dtype == FP8 and scale.shape == (6, 1)
        assert torch.equal(scale.view(torch.int32), scale_want.view(torch.int32))
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
        if residual:
            assert torch.equal(new_res, want_res)
        else:
            assert new_res is None


def test_rms_norm_fp8_refuses_what_it_cannot_take():
    from graphserve.kernels.rmsnorm import rms_norm_fp8

    x = torch.randn(2, 8)
    with pytest.raises(ValueError):
        rms_norm_fp8(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError):
        rms_norm_fp8(x, torch.ones(8), 1e-6, residual=torch.randn(3, 8))


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [896, 4096])
@pytest.mark.parametrize("m", [2, 64, 300])
def test_gpu_rms_norm_fp8_model_shapes(m, hidden, poisoned_outputs):
    """The fused norm + quantization at the two shapes' hidden sizes, bit for bit the two kernels."""
    from graphserve.kernels.rmsnorm import fused_add_rms_norm, rms_norm_fp8

    gen = torch.Generator(device="cuda").manual_seed(m * hidden)
    x = torch.randn(m, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 4
    res = torch.randn(m, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    q, scale, new_res = rms_norm_fp8(x, w, 1e-6, res)
    normed, want_res = fused_add_rms_norm(x, res, w, 1e-6)
    q_want, scale_want = quantize_rows_fp8(normed)
    assert torch.equal(scale.view(torch.int32), scale_want.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8))
    assert torch.equal(new_res, want_res)
