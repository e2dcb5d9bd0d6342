"""The CPU kernel over GGUF-quantized weights (engine/cpu/quant_linear.py) against gguf-py's own
dequantization, for each type, at ragged shapes (N not a multiple of 16, several K, prefill and
decode row counts), with and without bias, in this machine's build and in the builds a machine
with fewer instruction sets takes (tests/cpu_builds.py: every GRAPHSERVE_CPU_ISA level this machine
executes, and the pthreads pool).

The kernel quantizes the activations per row and block of 32 to int8 (as llama.cpp does), so two
claims are checked: (1) given those quantized activations, the result is x_q @ dequant(W).T to
float32 rounding (the block sums are exact int32); (2) against the float activations it is within
the bound that quantization implies: each x moves by at most half its block's step dx / 2, so
|out - x @ W.T| <= sum over blocks of dx_b / 2 * sum |W_b| (plus rounding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


gguf = pytest.importorskip("gguf", reason="gguf (gguf-py, a dependency of the CPU install) reads the files")

from cpu_builds import builds, loaded  # noqa: E402
from quant_references import TYPE, case, check_against_quantized_activations, dequantized, magnitudes  # noqa: E402

from graphserve.engine.cpu import quant_linear as ql  # noqa: E402

pytestmark = pytest.mark.skipif(not ql.available(), reason="no C compiler: the kernel is unavailable")

SHAPES_32 = [(37, 32), (100, 96), (16, 576), (49, 1536)]
SHAPES_256 = [(37, 256), (20, 768)]


@pytest.mark.parametrize("qtype,n,k", [(t, n, k) for t in ("Q8_0", "Q4_0", "Q4_1") for n, k in SHAPES_32]
                         + [(t, n, k) for t in ("Q4_K", "Q6_K") for n, k in SHAPES_256])
@pytest.mark.parametrize("rows", [1, 3, 16, 32, 70])
@pytest.mark.parametrize("with_bias", [True, False])
def test_matches_gguf_dequantization(qtype, n, k, rows, with_bias):
    raw, x, bias = case(qtype, n, k, rows, with_bias)
    weight = ql.pack_quantized(raw, qtype, n, k)
    assert weight is not None and weight.panels.shape[0] == -(-n // 16)
    out = ql.quant_linear(x, weight, bias)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    check_against_quantized_activations(out, raw, qtype, x, bias)
    # against the float activations: the activation quantization's own bound
    w = dequantized(raw, qtype)
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    _, dx = ql.quantize_activations(x)
    step = (dx.double()[..., None] / 2).expand(rows, k // ql.BLOCK, ql.BLOCK).reshape(rows, k)
    bound = step @ w.abs().T + 1e-5 * (x.double().abs() @ magnitudes(raw, qtype).T + 1)
    assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("library", builds(ql.LIBRARY))
@pytest.mark.parametrize("qtype,n,k", [("Q8_0", 37, 96), ("Q4_0", 50, 64), ("Q4_1", 33, 576), ("Q4_K", 21, 256),
                                       ("Q6_K", 40, 512)])
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_each_build_gives_the_same_numbers(library, qtype, n, k, rows):
    """Every instruction-set level this machine executes (a smaller machine's build) does the same
    arithmetic: exact int32 block sums, then the same float steps."""
    library = loaded(library)
    raw, x, bias = case(qtype, n, k, rows, True)
    weight = ql.pack_quantized(raw, qtype, n, k)
    out = ql.quant_linear(x, weight, bias, library=library)
    check_against_quantized_activations(out, raw, qtype, x, bias)
    torch.testing.assert_close(out, ql.quant_linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(ql.quantize_activations(x, library)[0], ql.quantize_activations(x)[0])


@pytest.mark.parametrize("qtype,k", [("Q4_1", 576), ("Q8_0", 96), ("Q6_K", 256)])
def test_a_rows_result_does_not_depend_on_the_other_rows(qtype, k):
    """Each row is quantized and summed on its own: the batch a request shares changes nothing,
    bit for bit (the engine's greedy invariant)."""
    raw, x, bias = case(qtype, 40, k, 37, True)
    weight = ql.pack_quantized(raw, qtype, 40, k)
    together = ql.quant_linear(x, weight, bias)
    for i in (0, 15, 16, 36):
        assert torch.equal(ql.quant_linear(x[i:i + 1], weight, bias)[0], together[i])
        assert torch.equal(ql.quant_linear(x[i:i + 5], weight, bias)[0], together[i])


def test_activation_quantization_moves_each_value_by_at_most_half_a_step():
    x = torch.randn(7, 96) * torch.logspace(-3, 3, 96)
    x[2, 32:64] = 0  # an all-zero block
    xq, dx = ql.quantize_activations(x)
    blocks = x.reshape(7, 3, 32)
    torch.testing.assert_close(dx, blocks.abs().amax(-1) / 127)
    assert xq.abs().max() <= 127 and (xq[2, 32:64] == 0).all()
    error = (blocks - xq.reshape(7, 3, 32).float() * dx[..., None]).abs()
    assert (error <= dx[..., None] * (0.5 + 1e-4)).all()


def test_strided_rows_read_their_own_elements():
    raw, _, _ = case("Q4_1", 40, 64, 1, False)
    weight = ql.pack_quantized(raw, "Q4_1", 40, 64)
    wide = torch.randn(5, 128)
    x = wide[:, 32:96]
    assert x.stride(0) == 128
    torch.testing.assert_close(ql.quant_linear(x, weight), ql.quant_linear(x.contiguous(), weight))


def test_packing_refuses_what_the_kernel_cannot_take():
    raw = gguf.quants.quantize(np.ones((4, 64), np.float32), TYPE.Q8_0)
    assert ql.pack_quantized(raw, "Q5_0", 4, 64) is None  # a type without a kernel
    assert ql.pack_quantized(np.zeros((4, 144), np.uint8), "Q4_K", 4, 128) is None  # K not whole super-blocks
    weight = ql.pack_quantized(raw, "Q8_0", 4, 64)
    assert not ql.applies(torch.randn(2, 64, dtype=torch.float64), weight)
    assert not ql.applies(torch.randn(2, 32), weight)
    assert ql.applies(torch.randn(2, 64), weight)
