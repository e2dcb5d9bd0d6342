"""MXFP4 (OCP Microscaling, FP4 elements): how gpt-oss checkpoints store their experts' weights.

A weight [..., N, K] is kept as `blocks` uint8 [..., N, K / 32, 16] and `scales` uint8 [..., N, K / 32]:
each byte of a block packs two 4-bit e2m1 values (element 2j in the low nibble, 2j + 1 in the high one;
sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), and each group
of 32 consecutive values along K shares one e8m0 scale, 2^(scale - 127).

dequantize() is transformers' integrations/mxfp4.py convert_moe_packed_tensors (before its final
transpose into transformers' [E, K, N] layout), the same operations in the same dtype, so its result
equals transformers' bit for bit (tests/test_gpt_oss.py). decode_tile() is the same in a Triton kernel's
registers (kernels/gpt_oss_experts.py, where tl.dot_scaled does not take the activations: float32), exact
for every scale but 0 and 255 (2^-127 and NaN in the spec; 0 and inf here, never in a checkpoint's
experts).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # values sharing one scale
GROUP_SIZE = tl.constexpr(GROUP)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., N, K] in `dtype` from blocks uint8 [..., N, K / 32, 16] (or [..., N, K / 2]) and scales uint8
    [..., N, K / 32]."""
    groups = scales.shape[-1]
    blocks = blocks.reshape(*scales.shape, -1).to(torch.uint8)
    if blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks of {blocks.shape[-1]} bytes a group, expected {GROUP // 2}")
    exponents = scales.to(torch.int32) - SCALE_BIAS
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    rows = blocks.numel() // (GROUP // 2)
    flat = blocks.reshape(rows, GROUP // 2)
    out = torch.empty(rows, GROUP, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(flat & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(flat >> 4).to(torch.int)]
    torch.ldexp(out, exponents.reshape(rows, 1), out=out)
    return out.reshape(*scales.shape[:-1], groups * GROUP)


@triton.jit
def decode_tile(packed, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """float32 [BLOCK_N, BLOCK_K] from packed uint8 [BLOCK_N, BLOCK_K / 2] (two e2m1 values a byte, the low
    nibble first) and scales uint8 [BLOCK_N, BLOCK_K / 32]. Each value's float32 bits are built directly:
    a magnitude code c = 2e + m >= 2 is 2^(e - 1) (1 + m / 2) (exponent field e + 126, the mantissa's top
    bit m), c = 1 is 0.5, c = 0 is 0; the scale 2^(s - 127) is float32 bits s << 23."""
    nibbles = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.int32)
    code = nibbles & 7
    bits = tl.where(code >= 2, (((code >> 1) + 126) << 23) | ((code & 1) << 22), tl.where(code == 1, 126 << 23, 0))
    values = (bits | ((nibbles & 8) << 28)).to(tl.float32, bitcast=True)
    scale = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return (values.reshape(BLOCK_N, BLOCK_K // GROUP_SIZE, GROUP_SIZE) * scale[:, :, None]).reshape(BLOCK_N, BLOCK_K)

