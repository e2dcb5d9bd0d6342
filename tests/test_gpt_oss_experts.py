"""kernels/gpt_oss_experts.py against its float32 torch reference: gpt-oss's experts (biases, the clamped
SwiGLU) with MXFP4 weights as stored (tl.dot_scaled beside fp16 / bf16 rows, decoded in registers beside float32
ones, or kernels/gpt_oss_gemv.py's decode) or unquantized, by the GEMV, small-batch and grouped paths, on the CPU under
TRITON_INTERPRET=1 at small shapes (K not a multiple of the K tile, 1 to 40 tokens), and on the GPU at
gpt-oss-20b's (hidden 2880, 32 experts, top 4, intermediate 2880). The in-register decode equals
kernels/mxfp4.dequantize bit for bit."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from tensor_checks import rel_err

from graphserve.kernels.gpt_oss_experts import gpt_oss_experts, gpt_oss_experts_ref
from graphserve.kernels.gpt_oss_gemv import GptOssGemvTile
from graphserve.kernels.moe import MoeTile
from graphserve.kernels.moe_route import route_fused
from graphserve.kernels.mxfp4 import decode_tile, dequantize

ALPHA, LIMIT = 1.702, 7.0


def experts_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype, mxfp4: bool,
                 device: str = "cpu", seed: int = 0) -> dict:
    """Inputs of gpt_oss_experts: activations and weights whose gate_up outputs reach past the clamp (a
    limit of 7 at the 20b's shapes, 0.8 at small ones), routing from random logits."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * std).to(dtype)

    def packed(rows: int, k: int):  # random e2m1 bytes, scales about 1 / sqrt(k) (gate_up outputs of about 1)
        blocks = torch.randint(0, 256, (experts, rows, k // 2), generator=gen, device=device, dtype=torch.uint8)
        base = 127 - round(torch.log2(torch.tensor(k ** 0.5 * 3)).item())
        scales = torch.randint(base - 1, base + 2, (experts, rows, k // 32), generator=gen, device=device,
                               dtype=torch.uint8)
        return blocks, scales

    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = route_fused(logits, top_k, renormalize=True)
    case = dict(x=randn(tokens, hidden, std=2.0), weights=weights, expert_ids=ids,
                gate_up_bias=randn(experts, 2 * inter, std=0.5), down_bias=randn(experts, hidden, std=0.5))
    if mxfp4:
        case["gate_up"], case["gate_up_scales"] = packed(2 * inter, hidden)
        case["down"], case["down_scales"] = packed(hidden, inter)
    else:
        case["gate_up"] = randn(experts, 2 * inter, hidden, std=hidden ** -0.5)
        case["down"] = randn(experts, hidden, inter, std=inter ** -0.5)
    return case


def _run(case: dict, limit: float, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernels' output, the reference's)."""
    scales = {k: case[k] for k in ("gate_up_scales", "down_scales") if k in case}
    args = [case[k] for k in ("x", "weights", "expert_ids", "gate_up", "down", "gate_up_bias", "down_bias")]
    out = gpt_oss_experts(*args, ALPHA, limit, **scales, **kwargs)
    return out, _reference(case, limit)


def _reference(case: dict, limit: float) -> torch.Tensor:
    scales = {k: case[k] for k in ("gate_up_scales", "down_scales") if k in case}
    args = [case[k] for k in ("x", "weights", "expert_ids", "gate_up", "down", "gate_up_bias", "down_bias")]
    return gpt_oss_experts_ref(*args, ALPHA, limit, **scales)


@pytest.mark.parametrize("tokens", [5, 40])  # the small-batch and the grouped paths (one or two: the GEMV's, below)
@pytest.mark.parametrize("mxfp4", [True, False], ids=["mxfp4", "unquantized"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_experts_match_the_reference(tokens, mxfp4, dtype):
    """hidden 96 and intermediate 160: multiples of MXFP4's 32, not of the K tile; the clamp at 0.8 cuts
    gate and up both."""
    case = experts_case(tokens, experts=6, top_k=2, hidden=96, inter=160, dtype=dtype, mxfp4=mxfp4, seed=tokens)
    out, ref = _run(case, limit=0.8)
    assert out.dtype == dtype and out.shape == (tokens, 96)
    assert rel_err(out.float(), ref) < (1e-5 if dtype == torch.float32 else 2e-3)
    assert rel_err(ref, _reference(case, limit=1e4)) > 1e-2  # the clamp mattered


def test_the_small_batch_path_reads_a_shared_expert_once_for_its_tokens():
    """7 tokens over 6 experts (top 2: experts shared by several tokens, run by the expert's first pick over all of
    them) by the small-batch path (no alignment), against the reference and the grouped path."""
    case = experts_case(7, experts=6, top_k=2, hidden=64, inter=64, dtype=torch.float16, mxfp4=True, seed=11)
    assert case["expert_ids"].unique().numel() < 7 * 2  # some expert serves two tokens
    small, ref = _run(case, limit=0.8, path="small")
    assert rel_err(small.float(), ref) < 2e-3
    assert rel_err(small.float(), _run(case, limit=0.8, path="grouped")[0].float()) < 1e-3


@pytest.mark.parametrize("tokens,dtype", [(1, torch.float32), (2, torch.float16)], ids=["fp32-1", "fp16-2"])
def test_the_gemv_path_matches_the_reference(tokens, dtype):
    """kernels/gpt_oss_gemv.py: the nibbles decoded through fp16's bits, K (96, 160) not a multiple of its K tile
    of 64 (fp16 rows: the interpreter's bfloat16 is not bfloat16; the GPU tests take bf16)."""
    case = experts_case(tokens, experts=6, top_k=2, hidden=96, inter=160, dtype=dtype, mxfp4=True, seed=20 + tokens)
    out, ref = _run(case, limit=0.8, path="gemv", tiles=(GptOssGemvTile(16, 64, 4), GptOssGemvTile(16, 64, 4)))
    assert out.dtype == dtype and rel_err(out.float(), ref) < (1e-5 if dtype == torch.float32 else 2e-3)


def test_explicit_tiles_and_bad_shapes():
    case = experts_case(3, experts=4, top_k=2, hidden=64, inter=64, dtype=torch.float32, mxfp4=True)
    out, ref = _run(case, LIMIT, tiles=(MoeTile(16, 32, 64, 4, 2), MoeTile(16, 16, 32, 4, 2)))
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ValueError, match="block_k"):
        _run(case, LIMIT, tiles=(MoeTile(16, 32, 16, 4, 2), MoeTile(16, 16, 16, 4, 2)))
    with pytest.raises(ValueError, match="at most 16 tokens"):
        _run(experts_case(17, experts=4, top_k=2, hidden=64, inter=64, dtype=torch.float32, mxfp4=True), LIMIT,
             path="small")
    with pytest.raises(ValueError, match="path 'gemv'"):
        _run(experts_case(1, experts=4, top_k=2, hidden=64, inter=64, dtype=torch.float32, mxfp4=False), LIMIT,
             path="gemv")
    with pytest.raises(ValueError, match="down_scales"):
        gpt_oss_experts(case["x"], case["weights"], case["expert_ids"], case["gate_up"], case["down"],
                        case["gate_up_bias"], case["down_bias"], ALPHA, LIMIT, gate_up_scales=case["gate_up_scales"])


@triton.jit
def _decode_kernel(packed_ptr, scales_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr):
    rows = tl.arange(0, N)[:, None]
    packed = tl.load(packed_ptr + rows * (K // 2) + tl.arange(0, K // 2)[None, :])
    scales = tl.load(scales_ptr + rows * (K // 32) + tl.arange(0, K // 32)[None, :])
    tl.store(out_ptr + rows * K + tl.arange(0, K)[None, :], decode_tile(packed, scales, N, K))


def test_the_register_decode_equals_the_dequantization_bit_for_bit():
    """Every byte of values, every scale 1..254 (0 and 255, 2^-127 and NaN, never in a checkpoint)."""
    packed = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(1, 4)  # [16, 64]: K = 128
    scales = torch.arange(1, 65, dtype=torch.uint8).reshape(16, 4) * 3 + torch.arange(16, dtype=torch.uint8)[:, None]
    out = torch.empty(16, 128)
    _decode_kernel[(1,)](packed, scales, out, N=16, K=128)
    assert scales.min() >= 1 and scales.max() <= 254
    assert torch.equal(out.view(torch.int32), dequantize(packed, scales).view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 4, 16, 64, 300])
def test_mxfp4_experts_at_gpt_oss_20b_shapes(tokens):
    """bf16 activations, MXFP4 weights (tl.dot_scaled; the GEMV's decode): hidden 2880, 32 experts, top 4,
    intermediate 2880, the clamp at 7 reached; each path that takes the batch (the GEMV path up to 2 tokens, the
    small-batch one up to 16, the grouped one)."""
    case = experts_case(tokens, experts=32, top_k=4, hidden=2880, inter=2880, dtype=torch.bfloat16, mxfp4=True,
                        device="cuda", seed=tokens)
    paths = ("gemv", "small", "grouped") if tokens <= 2 else ("small", "grouped") if tokens <= 16 else ("grouped",)
    for path in paths:
        out, ref = _run(case, LIMIT, path=path)
        assert rel_err(out.float(), ref) < 1e-2, path
    assert rel_err(ref, _reference(case, limit=1e4)) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unquantized_and_float32_experts_at_gpt_oss_20b_shapes(dtype):
    """bf16 experts (a bf16 checkpoint), and float32 rows with MXFP4 weights (decoded in registers)."""
    for mxfp4 in (False, True) if dtype == torch.float32 else (False,):
        case = experts_case(16, experts=32, top_k=4, hidden=2880, inter=2880, dtype=dtype, mxfp4=mxfp4,
                            device="cuda")
        out, ref = _run(case, LIMIT)
        assert rel_err(out.float(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)
