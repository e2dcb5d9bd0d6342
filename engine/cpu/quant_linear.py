"""The CPU backend's projections over GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K), kept
quantized in memory: out = x @ W.T (+ bias) for float32 x [M, K], any M (a small C function,
built by engine/cpu/build.py, as engine/cpu/linear.py).

Layout (`pack_quantized`, once at load): the weight in panels of 16 output rows, as linear.py's
float32 panels, each panel one contiguous stream [its blocks' quants | their scales | their mins],
64-byte aligned. A block is 32 values of K for the 16 rows; its quants are laid out for VNNI's
vpdpbusd, which multiplies 4 unsigned bytes by 4 signed bytes per 32-bit lane: 16 rows x 4
consecutive K per 64 bytes. 8-bit quants are stored unsigned (Q8_0 + 128, Q6_K + 32, so that the
weight is vpdpbusd's unsigned operand); 4-bit ones two to a byte (low nibble: K 0-15 of the
block, high: K 16-31, as GGUF's Q4_0 blocks). Scales and mins are GGUF's float16 (Q8_0, Q4_0,
Q4_1: the same bytes per weight as the file) or float32 where GGUF's two-level scales are
multiplied out exactly (Q4_K: 6 bits per weight instead of 4.5; Q6_K: unpacked to 8 bits with
two float32 scales per block, 10 bits instead of 6.6: simple and exact, not yet the smallest).

The embedded model's 30 layers on the 2-core development machine (benchmarks/cpu_quant_bench.py,
best of 9, kinds interleaved; ms per pass, float32 panels / Q8_0 / Q4_0 / Q4_1): 1 row 16.9 / 5.4 /
3.5 / 3.9, 4 rows 18.4 / 6.8 / 4.5 / 5.2, 8 rows 20.4 / 7.8 / 5.6 / 6.5, 16 rows 23.9 / 10.7 / 8.2 / 9.1.

Activations are quantized per row and block of 32 to int8 with a float scale (llama.cpp's Q8
activations), and each block's products are summed exactly in int32 by vpdpbusd (64 products per
instruction), then scaled once per block in float32. The alternative, dequantizing the weight to
float32 in registers and one FMA per weight and row (exact activations), was slower at every row
count on the 2-core development machine (AVX-512 VNNI), Q4_1, the embedded model's 30 layers, best
of 9, interleaved: 1 row 6.3 ms against 4.2 here, 4 rows 7.0 / 5.6, 8 rows 8.9 / 7.0, 16 rows
14.9 / 9.6, 32 rows 28.7 / 15.6: unpacking costs ~7 instructions per 32 weights besides the FMAs.
The price: each activation moves by at most half its block's step (amax / 254), the error
llama.cpp's CPU path has too (~0.5% of the largest output on Gaussian data);
tests/test_quant_linear.py bounds it. On the embedded model (its Q4_1 projections and Q8_0 LM
head, teacher-forced over 1,024 tokens of docs/architecture.md) the next-token argmax agreed with
the float-activation path on the same weights at 95.6% of positions, mean KL 0.0036.

Prefill too: from 70 rows up this kernel beat torch's float32 F.linear (MKL) on the same shapes
(70 rows 30 ms against 65, 128 rows 53 / 94, 256 rows 103 / 165, Q4_0; int8 products run 4x as
many per instruction as float32 FMAs), so every row count takes it and nothing is dequantized
(benchmarks/cpu_quant_bench.py, benchmarks/results/cpu_quant_bench-cpu-2026-12-05.json).

Machines without AVX-512 VNNI take, by the compiler's feature macros, the same arithmetic (same
layout, same exact int32 block sums) on 256-bit registers with AVX-VNNI's vpdpbusd or AVX2's
vpmaddubsw + vpmaddwd, else in plain C (correct, not fast). Those builds on this machine (30
layers, best of 5, interleaved; 1 / 8 / 16 rows, ms): Q4_1 AVX-512 VNNI 3.9 / 6.3 / 10.0, AVX-VNNI
4.0 / 7.2 / 11.9, AVX2 3.8 / 8.8 / 14.9, plain C 14.2 / 53 / 99; Q8_0 4.7 / 8.2 / 11.3, 5.1 / 8.8 /
13.2, 5.7 / 10.6 / 17.8, 15.1 / 59 / 111. ARM64 machines take it on NEON (i8mm's smmla, dotprod's
sdot, else vmull_s8: quant_linear_neon.h), checked under qemu only (tests/test_cpu_arm.py), its
speed not measured.
`pack_quantized()` returns None where the kernel cannot be built (no compiler,
GRAPHSERVE_CPU_QUANT=torch): the caller keeps float weights.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass

import numpy as np
import torch

from graphserve.engine.cpu.build import CLibrary

PANEL, BLOCK = 16, 32
# GGUF type name -> the kernel's type code (the C enum below)
TYPES = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q4_K": 3, "Q6_K": 4}
# GGUF type name -> (values, bytes) of one of its blocks along K
GGUF_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
# A converted GGUF folder's projection weights as the file's blocks (written by
# engine/model_files/gguf_import.py, read by engine/models/loading/loader.py): uint8 [n, bytes per row] per
# tensor under the checkpoint's names; the file's metadata maps each name to its GGUF type.
# in a folder of its own: tools that load every top-level *.safetensors of a model folder (vLLM) must not see it
GGUF_BLOCKS_FILE = "gguf/blocks.safetensors"


_i32, _i64, _ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
LIBRARY = CLibrary("quant_linear", "quant_linear.c", {
    "quant_linear": ([_i32, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64], None),
    "quantize_rows": ([_ptr, _i64, _i64, _i64, _ptr, _ptr], None),
}, disable_env="GRAPHSERVE_CPU_QUANT")


@dataclass(frozen=True)
class QuantizedWeight:
    """A [n, k] weight in the kernel's layout: `panels` uint8 [ceil(n / 16), panel bytes]."""
    qtype: str  # the GGUF type name
    n: int
    k: int
    panels: torch.Tensor

    def __post_init__(self) -> None:
        # the kernel reads panels with aligned vector loads: a misaligned tensor would crash it
        if self.panels.data_ptr() % 64 or self.panels.stride(-1) != 1 or self.panels.dtype != torch.uint8:
            raise ValueError("quantized panels must be contiguous uint8 rows starting on a 64-byte boundary")

    @property
    def nbytes(self) -> int:
        return self.panels.numel()


def available() -> bool:
    return LIBRARY.get() is not None


def _float_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype(np.float32)).view(np.uint8)


def _unpack(raw: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """GGUF blocks [n, bytes per row] -> (unsigned quants uint8 [n, k], scale fields as bytes [n,
    k / 32, bytes]: scales, then mins where the type has them)."""
    import gguf

    nb = k // BLOCK
    if qtype == "Q8_0":
        blocks = raw.reshape(n, nb, 34)
        return (blocks[..., 2:] ^ np.uint8(0x80)).reshape(n, k), [blocks[..., :2]]
    if qtype in ("Q4_0", "Q4_1"):
        head = 2 if qtype == "Q4_0" else 4
        blocks = raw.reshape(n, nb, head + 16)
        qs = blocks[..., head:]
        quants = np.concatenate([qs & np.uint8(15), qs >> np.uint8(4)], axis=-1).reshape(n, k)
        return quants, [blocks[..., :2]] if head == 2 else [blocks[..., :2], blocks[..., 2:4]]
    if qtype == "Q4_K":  # super-blocks of 256: 8 sub-blocks with 6-bit scales and mins
        blocks = raw.reshape(n * (k // 256), 144)
        d = blocks[:, 0:2].view(np.float16).astype(np.float32)
        dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        quants = (qs & np.uint8(15)).reshape(n, k)
        scales = (d * sc.astype(np.float32)).reshape(n, nb, 1)  # exact: 11-bit x 6-bit
        mins = (-dmin * mn.astype(np.float32)).reshape(n, nb, 1)
        return quants, [_float_bytes(scales), _float_bytes(mins)]
    if qtype == "Q6_K":  # super-blocks of 256: 16 sub-blocks of 16 with int8 scales
        blocks = raw.reshape(n * (k // 256), 210)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = blocks[:, 208:210].view(np.float16).astype(np.float32)
        low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        quants = (low.reshape(-1, 2, 4, 32) | (high << np.uint8(4))).reshape(n, k)
        scales = (d * sc).reshape(n, nb, 2, 1)  # exact: 11-bit x 8-bit; [first half, second half]
        return quants, [_float_bytes(scales).reshape(n, nb, 2, 4)]
    raise ValueError(f"no quantized kernel for {qtype}")


def pack_quantized(raw: np.ndarray | torch.Tensor, qtype: str, n: int, k: int) -> QuantizedWeight | None:
    """A GGUF tensor's bytes (uint8 [n, bytes per row], as gguf's reader gives them) for a weight
    [n, k], repacked for the kernel; None where the kernel does not apply (not built here, a type
    it lacks, k not a whole number of the type's blocks)."""
    if qtype not in TYPES or k % GGUF_BLOCKS[qtype][0] or LIBRARY.get() is None:
        return None
    raw = np.ascontiguousarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw).view(np.uint8).reshape(n, -1)
    quants, fields = _unpack(raw, qtype, n, k)
    count, nb = -(-n // PANEL), k // BLOCK
    pad = count * PANEL - n
    quants = np.pad(quants, ((0, pad), (0, 0))).reshape(count, PANEL, nb, BLOCK).transpose(0, 2, 1, 3)
    if qtype in ("Q8_0", "Q6_K"):  # [panel, block, group of 4 K, row, 4]
        qs = quants.reshape(count, nb, PANEL, 8, 4).transpose(0, 1, 3, 2, 4)
    else:  # bytes: low nibble K 0-15, high K 16-31; [panel, block, group, row, 4]
        qs = quants[..., :16] | (quants[..., 16:] << np.uint8(4))
        qs = qs.reshape(count, nb, PANEL, 4, 4).transpose(0, 1, 3, 2, 4)
    parts = [np.ascontiguousarray(qs).reshape(count, -1)]
    for field in fields:  # [n, nb, (halves,) bytes] -> [panel, block, (halves,) row, bytes]
        field = np.pad(field.reshape(n, nb, -1, field.shape[-1]), ((0, pad), (0, 0), (0, 0), (0, 0)))
        parts.append(np.ascontiguousarray(field.reshape(count, PANEL, nb, *field.shape[2:]).transpose(0, 2, 3, 1, 4))
                     .reshape(count, -1))
    stride = -(-sum(p.shape[1] for p in parts) // 64) * 64
    panels = torch.zeros((count, stride), dtype=torch.uint8)
    panels[:, :sum(p.shape[1] for p in parts)] = torch.from_numpy(np.concatenate(parts, axis=1))
    return QuantizedWeight(qtype, n, k, panels)


def applies(x: torch.Tensor, weight: QuantizedWeight | None) -> bool:
    return (weight is not None and x.dim() == 2 and x.shape[0] >= 1 and x.shape[1] == weight.k
            and x.dtype == torch.float32 and x.stride(-1) == 1)


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 library: CLibrary = LIBRARY) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) -> [M, n] float32, the activations quantized per row and block of 32
    (the module docstring); the caller checked applies()."""
    lib = library.get()
    rows = x.shape[0]
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
    out = torch.empty((rows, weight.n), dtype=torch.float32)
    lib.quant_linear(TYPES[weight.qtype], x.data_ptr(), rows, x.stride(0), weight.panels.data_ptr(), weight.n,
                     weight.k, weight.panels.shape[1], None if bias is None else bias.data_ptr(), out.data_ptr(),
                     weight.n)
    return out


def quantize_activations(x: torch.Tensor, library: CLibrary = LIBRARY) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's own quantization of x [M, K] (float32, rows contiguous): (int8 [M, K], float32
    scales [M, K / 32]), so that x ~ xq * scale per block."""
    lib = library.get()
    rows, k = x.shape
    xq, dx = torch.empty((rows, k), dtype=torch.int8), torch.empty((rows, k // BLOCK), dtype=torch.float32)
    lib.quantize_rows(x.data_ptr(), rows, x.stride(0), k, xq.data_ptr(), dx.data_ptr())
    return xq, dx


if __name__ == "__main__":  # build it now (e.g. in a Docker image) and say whether it works
    logging.basicConfig(level=logging.INFO)
    print("CPU quantized linear:", LIBRARY.isa() or "unavailable", file=sys.stderr)
