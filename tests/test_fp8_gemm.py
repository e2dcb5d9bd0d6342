"""kernels.fp8_gemm: the W8A8 projection for decode batches against its float32 reference, with
and without split K, bias, ragged edges. CPU tests run in Triton's interpreter at small shapes;
the `gpu` ones at model shapes on CUDA, and inside a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_gemm import Fp8GemmTile, default_fp8_gemm_tile, fp8_gemm, fp8_gemm_ref
from tensor_checks import rel_err

FP8 = torch.float8_e4m3fn


def operands(m: int, n: int, k: int, device: str = "cpu", seed: int = 0, bias: bool = False):
    gen = torch.Generator(device=device).manual_seed(seed)
    xq = (torch.randn(m, k, generator=gen, device=device) * 40).clamp(-448, 448).to(FP8)
    wq = (torch.randn(n, k, generator=gen, device=device) * 40).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(m, 1, generator=gen, device=device) * 1e-2 + 1e-4
    w_scale = torch.rand(n, generator=gen, device=device) * 1e-3 + 1e-5
    b = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if bias else None
    return xq, x_scale, wq, w_scale, b


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "an output the kernel never wrote"
    if out.dtype == torch.float32:  # only the summation order differs
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:  # at most one rounding step of the output dtype apart
        ulp = ref.float().abs() * 2.0 ** -7 + 1e-6
        assert ((out.float() - ref.float()).abs() <= ulp).all(), rel_err(out, ref)


# (m, n, k, tile): one program column; ragged N / M / K edges; split K (exact and ragged)
CASES = [
    pytest.param(4, 32, 64, Fp8GemmTile(16, 32, 16, 1, 4, 2), id="plain"),
    pytest.param(5, 40, 72, Fp8GemmTile(16, 32, 16, 1, 4, 2), id="ragged-edges"),
    pytest.param(3, 32, 128, Fp8GemmTile(16, 32, 16, 4, 4, 2), id="split-4"),
    pytest.param(18, 24, 100, Fp8GemmTile(16, 32, 16, 3, 4, 2), id="split-ragged-two-row-blocks"),
]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,n,k,tile", CASES)
def test_matches_ref(m, n, k, tile, bias, out_dtype, poisoned_outputs):
    xq, x_scale, wq, w_scale, b = operands(m, n, k, seed=m * n + k, bias=bias)
    out = fp8_gemm(xq, x_scale, wq, w_scale, b, out_dtype=out_dtype, tile=tile)
    assert_close(out, fp8_gemm_ref(xq, x_scale, wq, w_scale, b, out_dtype=out_dtype))


def test_split_results_do_not_depend_on_the_split_count():
    """Splitting K changes only the order of the float32 sums: each result stays within
    float32 rounding of the one-pass result."""
    xq, x_scale, wq, w_scale, _ = operands(4, 32, 128, seed=7)
    one = fp8_gemm(xq, x_scale, wq, w_scale, out_dtype=torch.float32, tile=Fp8GemmTile(16, 32, 16, 1, 4, 2))
    for split in (2, 4):
        many = fp8_gemm(xq, x_scale, wq, w_scale, out_dtype=torch.float32, tile=Fp8GemmTile(16, 32, 16, split, 4, 2))
        torch.testing.assert_close(many, one, rtol=1e-5, atol=1e-5 * one.abs().max().item())


def test_default_tile_splits_narrow_projections_only():
    sms = 132
    down = default_fp8_gemm_tile(64, 4096, 14336, sms)  # Llama-3.1-8B down_proj: 32 output tiles
    gate_up = default_fp8_gemm_tile(64, 28672, 4096, sms)  # 224 output tiles
    assert down.split > 1 and 14336 // down.split >= 1024
    assert gate_up.split == 1
    assert default_fp8_gemm_tile(8, 4096, 4096, sms).block_m == 16
    assert default_fp8_gemm_tile(64, 4096, 4096, sms).block_m == 64


def test_rejects_bad_operands():
    xq, x_scale, wq, w_scale, _ = operands(4, 32, 64)
    with pytest.raises(ValueError):
        fp8_gemm(xq.float(), x_scale, wq, w_scale)  # not FP8
    with pytest.raises(ValueError):
        fp8_gemm(xq, x_scale, wq[:, :32], w_scale)  # K differs
    with pytest.raises(ValueError):
        fp8_gemm(xq, x_scale[:2], wq, w_scale)  # one scale per row
    with pytest.raises(ValueError):
        fp8_gemm(xq, x_scale, wq, w_scale.double())


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 8, 16, 64, 128])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1152, 896), (896, 4864)])
def test_gpu_model_shapes(m, n, k, poisoned_outputs):
    xq, x_scale, wq, w_scale, b = operands(m, n, k, device="cuda", seed=m + n + k, bias=n == 1152)
    out = fp8_gemm(xq, x_scale, wq, w_scale, b, out_dtype=torch.bfloat16)
    assert_close(out, fp8_gemm_ref(xq, x_scale, wq, w_scale, b, out_dtype=torch.bfloat16))


@pytest.mark.gpu
def test_gpu_graph_capture_replays_new_inputs():
    xq, x_scale, wq, w_scale, _ = operands(64, 4096, 14336, device="cuda", seed=1)  # a split-K shape
    fp8_gemm(xq, x_scale, wq, w_scale)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm(xq, x_scale, wq, w_scale)
    fresh = operands(64, 4096, 14336, device="cuda", seed=2)
    xq.copy_(fresh[0])
    x_scale.copy_(fresh[1])
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, fp8_gemm_ref(xq, x_scale, wq, w_scale))
