"""The references of the CPU kernel over GGUF-quantized weights (engine/cpu/quant_linear.py), shared
by its x86 builds' tests (tests/test_quant_linear.py) and its ARM builds' (tests/test_cpu_arm.py):
GGUF weights from gguf-py, its dequantization, and the bound of the kernel's float steps given its
own quantized activations. Import it after pytest.importorskip("gguf")."""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import torch

from graphserve.engine.cpu import quant_linear as ql

TYPE = gguf.GGMLQuantizationType
EPS = torch.finfo(torch.float32).eps
# the bytes of each type's min field inside a block (zeroed to split the dequantized weight into
# scale * quant and min for the rounding bound)
MIN_FIELD = {"Q4_1": slice(2, 4), "Q4_K": slice(2, 4)}


def gguf_weight(qtype: str, n: int, k: int, seed: int) -> np.ndarray:
    """A weight [n, k] in GGUF's bytes: gguf-py's quantization of random floats where it has one
    (Q8_0, Q4_0, Q4_1), otherwise random blocks (every quant and sub-scale bit pattern) with a
    small positive float16 super-scale."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, TYPE[qtype])
    size = gguf.GGML_QUANT_SIZES[TYPE[qtype]][1]
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    scale_at = [slice(0, 2), slice(2, 4)] if qtype == "Q4_K" else [slice(208, 210)]
    for where in scale_at:
        scale = rng.uniform(1e-4, 1e-3, size=(n, k // 256)).astype(np.float16)
        blocks[..., where] = scale.view(np.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def dequantized(raw: np.ndarray, qtype: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, TYPE[qtype]).astype(np.float64))


def magnitudes(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """|scale * quant| + |min| per weight: what the kernel's float steps round against."""
    w = dequantized(raw, qtype)
    if qtype not in MIN_FIELD:
        return w.abs()
    size = gguf.GGML_QUANT_SIZES[TYPE[qtype]][1]
    blocks = raw.copy().reshape(raw.shape[0], -1, size)
    blocks[..., MIN_FIELD[qtype]] = 0
    scaled = dequantized(blocks.reshape(raw.shape), qtype)
    return scaled.abs() + (w - scaled).abs()


def case(qtype: str, n: int, k: int, rows: int, with_bias: bool):
    seed = zlib.crc32(repr((qtype, n, k, rows, with_bias)).encode())
    raw = gguf_weight(qtype, n, k, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[:, :7] *= 20  # blocks with an outlier, as real activations have
    bias = torch.randn(n, generator=gen) if with_bias else None
    return raw, x, bias


def check_against_quantized_activations(out, raw, qtype, x, bias, library=ql.LIBRARY):
    """out is x_q @ dequant(W).T (+ bias), x_q the activations as `library` quantizes them, to
    float32 rounding"""
    xq, dx = ql.quantize_activations(x, library)
    xd = (xq.double().reshape(x.shape[0], -1, ql.BLOCK) * dx.double()[..., None]).reshape(x.shape)
    w = dequantized(raw, qtype)
    reference = xd @ w.T + (0 if bias is None else bias.double())
    # one float32 rounding per block term and per accumulation over the K / 32 blocks
    bias_size = 0 if bias is None else bias.double().abs()
    bound = (x.shape[1] // ql.BLOCK + 8) * EPS * (xd.abs() @ magnitudes(raw, qtype).T + bias_size)
    assert ((out.double() - reference).abs() <= bound).all(), (out.double() - reference).abs().max()
