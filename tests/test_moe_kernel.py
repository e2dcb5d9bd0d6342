"""graphserve.kernels.moe and moe_align: the fused mixture-of-experts path (route, align, grouped gate_up GEMM with
SiLU-and-mul, down GEMM with the routing weights, combine). On the CPU, in Triton's interpreter at
tiny shapes, float32: against engine/models/moe/sparse.py's torch path (route + combine_experts), moe_align's
invariants, and the edge cases (an idle expert, every token on one expert, ties in the router). FP8
experts (float8 e4m3, a float32 scale per expert and output channel) against the float32 reference on
their dequantized weights, in float32 and fp16 (the interpreter rounds float32 to bf16 toward zero, so
bf16 is the GPU tests'). The `gpu` tests: Qwen3-30B-A3B and Mixtral-8x7B layers in bf16 against a
float32 reference on the same weights, with poisoned outputs; FP8 experts at Qwen3-30B-A3B's shape;
CUDA-graph replay equal to eager; SparseMoE on CUDA."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from tensor_checks import rel_err

from graphserve.engine.models.fp8 import FP8, dequantize, quantize_experts
from graphserve.engine.models.hf_config.moe import MoeArgs
from graphserve.engine.models.moe.sparse import SparseMoE, combine_experts
from graphserve.kernels.gemv import GemvTile
from graphserve.kernels.moe import MoeTile, default_moe_tiles, fused_moe, fused_moe_ref, route
from graphserve.kernels.moe_align import max_padded_picks, moe_align, moe_align_torch
from graphserve.kernels.moe_gemv import GEMV_MAX_TOKENS, experts_gemv
from graphserve.kernels.moe_route import route_fused

align_module = importlib.import_module("graphserve.kernels.moe_align")
ALIGNS = {"kernel": moe_align, "torch": moe_align_torch}

F32_TOL = dict(rtol=1e-5, atol=2e-6)
# FP8 in float32: the kernel scales the sum (x @ q) * s, the reference sums x @ (q * s): roundings apart
FP8_F32_REL_ERR = 2e-6


def moe_weights(experts: int, hidden: int, inter: int, dtype=torch.float32, device="cpu", seed: int = 0):
    """gate_up [E, 2I, H] and down [E, H, I] scaled so every output is O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen, device=device) / inter**0.5).to(dtype)
    return gate_up, down


def torch_path(x, logits, gate_up, down, top_k, renormalize) -> torch.Tensor:
    """engine/models/moe/sparse.py's CPU path: route, then each expert over its tokens."""
    weights, experts = route(logits, top_k, renormalize)
    return combine_experts(x, weights, experts, gate_up, down)


def lowest_id_top_k(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of each row, ties to the lowest id (a stable descending sort): the GPU path's rule."""
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :top_k], ids[:, :top_k]


def per_token_reference(x, logits, gate_up, down, top_k, renormalize) -> torch.Tensor:
    """Independent of the kernels' routing: softmax, the top k by a stable sort (ties to the lowest
    expert id), each pick's expert token by token."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, picks = lowest_id_top_k(probs, top_k)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], picks[t]):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weight * (down[e] @ (F.silu(gate) * up))
    return out


# (tokens, experts, top_k, hidden, inter): decode-sized (the GEMV path) and past it (the grouped GEMMs)
CASES = [(t, e, k, h, i) for t, (h, i) in zip((1, 3, 17), ((32, 32), (64, 48), (32, 48)))
         for e in (4, 8) for k in (1, 2)] + [(2, 4, 2, 1100, 16)]  # the combine over several blocks of H


# each case by the path its size takes, and by the other path: the grouped GEMMs at every decode size, the
# GEMV path past its sizes once (tokens sharing experts; slow in the interpreter)
PATH_CASES = [(*case, "by-size") for case in CASES] + [
    (*case, "the-other") for case in CASES if case[0] < 17 or case[1:3] == (8, 2)]


@torch.no_grad()
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter, path", PATH_CASES)
def test_fused_moe_matches_the_torch_path(tokens, experts, top_k, hidden, inter, path, poisoned_outputs):
    """Both paths at every size: the one fused_moe takes for the size, and the other (the GEMV path
    past its sizes too, where tokens share experts)."""
    gemv = None if path == "by-size" else tokens > GEMV_MAX_TOKENS
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    gate_up, down = moe_weights(experts, hidden, inter, seed=tokens)
    renormalize = top_k % 2 == 0 or tokens == 3
    out = fused_moe(x, logits, gate_up, down, top_k, renormalize, gemv=gemv)
    torch.testing.assert_close(out, torch_path(x, logits, gate_up, down, top_k, renormalize), **F32_TOL)


@torch.no_grad()
@pytest.mark.parametrize("tiles", [
    # several K tiles; ragged output tiles (48 of 64, in gate_up) and a ragged last K tile (down)
    (MoeTile(16, 32, 32, 4, 2), MoeTile(16, 32, 32, 4, 2)),
    # blocks of 32 picks: experts' runs padded further; different tiles per GEMM
    (MoeTile(32, 16, 16, 4, 2), MoeTile(32, 64, 64, 4, 2)),
], ids=["ragged", "block_m-32"])
def test_fused_moe_with_explicit_tiles(tiles, poisoned_outputs):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen)
    logits = torch.randn(9, 4, generator=gen)
    gate_up, down = moe_weights(4, 64, 48)
    out = fused_moe(x, logits, gate_up, down, 2, True, tiles=tiles)
    torch.testing.assert_close(out, torch_path(x, logits, gate_up, down, 2, True), **F32_TOL)


def check_alignment(expert_ids: torch.Tensor, num_experts: int, block_m: int, align=moe_align) -> None:
    """align runs on expert_ids' device (a Triton kernel on CUDA takes CUDA tensors only); its result
    is checked on the CPU."""
    aligned = align(expert_ids, num_experts, block_m)
    picks = expert_ids.reshape(-1).cpu()
    num_picks = picks.numel()
    sorted_picks = aligned.sorted_picks.cpu().long()
    assert sorted_picks.shape == (max_padded_picks(num_picks, num_experts, block_m),)
    assert aligned.block_experts.shape == (sorted_picks.shape[0] // block_m,)
    real = sorted_picks[sorted_picks != num_picks]
    assert torch.equal(real.sort().values, torch.arange(num_picks)), "every pick exactly once"
    assert ((sorted_picks >= 0) & (sorted_picks <= num_picks)).all(), "padding is the sentinel"
    counts = torch.bincount(picks, minlength=num_experts)
    num_padded = int(((counts + block_m - 1) // block_m * block_m).sum())
    assert aligned.num_padded.tolist() == [num_padded]
    assert (sorted_picks[num_padded:] == num_picks).all()
    blocks = sorted_picks[:num_padded].view(-1, block_m)
    block_experts = aligned.block_experts.cpu().long()
    assert (block_experts[num_padded // block_m:] == -1).all()
    used = block_experts[:num_padded // block_m]
    assert (used[1:] >= used[:-1]).all(), "blocks in ascending expert order"
    for block, expert in zip(blocks, used.tolist()):
        members = block[block != num_picks]
        assert len(members) > 0, "no block of padding only"
        assert (picks[members] == expert).all(), "a block holds one expert's picks"
        assert (members[1:] > members[:-1]).all(), "an expert's picks in order"
    for expert in range(num_experts):  # each expert's picks in ceil(count / block_m) blocks
        assert int((used == expert).sum()) == -(-int(counts[expert]) // block_m)


# several chunks of the kernel's passes: (64, 8, 16, 16) and (100, 8, 128, 64)
ALIGN_CASES = [(1, 1, 4, 16), (1, 8, 128, 16), (5, 2, 8, 4), (17, 2, 8, 16), (40, 3, 6, 4), (64, 8, 16, 16),
               (100, 8, 128, 64)]


@pytest.mark.parametrize("align", sorted(ALIGNS))
@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", ALIGN_CASES)
def test_moe_align_invariants(tokens, top_k, num_experts, block_m, align):
    gen = torch.Generator().manual_seed(tokens)
    routed = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices  # distinct, as route's
    check_alignment(routed, num_experts, block_m, ALIGNS[align])
    check_alignment(torch.randint(0, num_experts, (tokens, top_k), generator=gen), num_experts, block_m,
                    ALIGNS[align])


@pytest.mark.parametrize("align", sorted(ALIGNS))
@pytest.mark.parametrize("case", ["idle expert", "one expert takes all"])
def test_moe_align_edge_routings(case, align):
    expert_ids = torch.tensor([[0, 2], [2, 3], [3, 0], [0, 2]]) if case == "idle expert" else torch.full((20, 1), 3)
    check_alignment(expert_ids, 4, 4, ALIGNS[align])


@pytest.mark.parametrize("tokens, top_k, num_experts, block_m", ALIGN_CASES)
def test_the_align_kernel_equals_the_torch_align(tokens, top_k, num_experts, block_m, poisoned_outputs):
    gen = torch.Generator().manual_seed(tokens + 1)
    expert_ids = torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices
    got, want = moe_align(expert_ids, num_experts, block_m), moe_align_torch(expert_ids, num_experts, block_m)
    for name, a, b in zip(got._fields, got, want):
        assert a == b if name == "block_m" else torch.equal(a, b), name


@torch.no_grad()
def test_fused_moe_through_the_torch_align(monkeypatch, poisoned_outputs):
    """Past ALIGN_KERNEL_MAX_PICKS picks (large batches) the alignment is the torch one."""
    monkeypatch.setattr(align_module, "ALIGN_KERNEL_MAX_PICKS", 0)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(17, 32, generator=gen)
    logits = torch.randn(17, 8, generator=gen)
    gate_up, down = moe_weights(8, 32, 48)
    torch.testing.assert_close(fused_moe(x, logits, gate_up, down, 2, True),
                               torch_path(x, logits, gate_up, down, 2, True), **F32_TOL)


def test_small_batches_read_each_chosen_expert_once():
    """At decode sizes every chosen expert's picks share one block: its weights are read once."""
    for tokens in (1, 4, 16):
        tile, down_tile = default_moe_tiles(tokens, 8, 128, 2048, 768, 132)
        assert tile.block_m == down_tile.block_m >= tokens
        gen = torch.Generator().manual_seed(tokens)
        expert_ids = torch.rand(tokens, 128, generator=gen).topk(8, dim=-1).indices
        aligned = moe_align(expert_ids, 128, tile.block_m)
        used = aligned.block_experts[aligned.block_experts >= 0]
        assert len(used) == len(expert_ids.unique()) == len(used.unique())


@torch.no_grad()
@pytest.mark.parametrize("tokens", [17, GEMV_MAX_TOKENS], ids=["grouped", "gemv"])
@pytest.mark.parametrize("top_k", [1, 2])
def test_an_idle_expert_and_one_expert_taking_every_token(top_k, tokens, poisoned_outputs):
    experts, hidden, inter = 8, 32, 48
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = moe_weights(experts, hidden, inter, seed=3)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 5] = -30.0  # idle
    logits[:, 2] = 30.0  # every token's first pick
    _, picks = route(logits, top_k, False)
    assert (picks[:, 0] == 2).all() and not (picks == 5).any()
    out = fused_moe(x, logits, gate_up, down, top_k, False)
    torch.testing.assert_close(out, per_token_reference(x, logits, gate_up, down, top_k, False), **F32_TOL)
    torch.testing.assert_close(out, torch_path(x, logits, gate_up, down, top_k, False), **F32_TOL)


@torch.no_grad()
@pytest.mark.parametrize("tie", ["three experts tie for two places", "all experts tie"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_router_ties_pick_the_reference_experts(tie, renormalize, poisoned_outputs):
    """Equal logits: the kernel path picks the lowest expert ids among equals (a different pick would
    change the output: every expert's weights differ). (torch.topk on the CPU picks other ones: 6 and 5
    of eight zeros; on CUDA its set is the lowest ids', test_routing_picks_the_set_cuda_topk_picks.)"""
    tokens, experts, hidden, inter = 5, 8, 32, 32
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = moe_weights(experts, hidden, inter, seed=4)
    logits = torch.randn(tokens, experts, generator=gen) - 5.0
    if tie == "all experts tie":
        logits.zero_()
    else:
        logits[:, [1, 4, 6]] = 0.5
    out = fused_moe(x, logits, gate_up, down, 2, renormalize)
    torch.testing.assert_close(out, per_token_reference(x, logits, gate_up, down, 2, renormalize), **F32_TOL)


@pytest.mark.parametrize("experts, top_k", [(128, 8), (8, 2), (60, 4), (1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_routing_equals_softmax_top_k_and_renormalization(experts, top_k, dtype, renormalize):
    """route_fused against softmax, a stable top k and the division: the same experts in the same order
    (bf16 logits tie often: the lowest ids first), weights within float32 rounding."""
    gen = torch.Generator().manual_seed(experts + top_k)
    logits = (torch.randn(9, experts, generator=gen) * 2).to(dtype)
    weights, ids = route_fused(logits, top_k, renormalize)
    want_weights, want_ids = lowest_id_top_k(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k)
    if renormalize:
        want_weights = want_weights / want_weights.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=2e-6, atol=1e-8)


def test_fused_routing_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="experts"):
        route_fused(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="experts"):
        route_fused(torch.zeros(2, 2048), 8, True)


def test_mismatched_shapes_are_refused():
    gate_up, down = moe_weights(4, 32, 32)
    with pytest.raises(ValueError):
        fused_moe(torch.randn(3, 64), torch.randn(3, 4), gate_up, down, 2, True)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe(torch.randn(3, 32), torch.randn(3, 4), gate_up, down, 2, True,
                  tiles=(MoeTile(16, 16, 16, 4, 2), MoeTile(32, 16, 16, 4, 2)))


# ---- FP8 experts (weight-only: e4m3 tiles widened in registers, scales on the accumulator) ----

def fp8_moe_weights(experts: int, hidden: int, inter: int, device="cpu", seed: int = 0):
    """(gate_up, gate_up_scale, down, down_scale): moe_weights quantized per expert and output
    channel, with rows of very different sizes, so a scale taken from the wrong row shows."""
    gate_up, down = moe_weights(experts, hidden, inter, device=device, seed=seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    gate_up = gate_up * torch.rand(experts, 2 * inter, 1, generator=gen, device=device).mul(4).exp2()
    down = down * torch.rand(experts, hidden, 1, generator=gen, device=device).mul(4).exp2()
    (gate_up, gate_up_scale), (down, down_scale) = quantize_experts(gate_up), quantize_experts(down)
    return gate_up, gate_up_scale, down, down_scale


def fp8_reference(x, logits, gate_up, gate_up_scale, down, down_scale, top_k, renormalize) -> torch.Tensor:
    """Per token, in float32, on the dequantized weights (independent of kernels.moe)."""
    return per_token_reference(x.float(), logits, dequantize(gate_up, gate_up_scale, torch.float32),
                               dequantize(down, down_scale, torch.float32), top_k, renormalize)


FP8_CASES = [(1, 8, 2, 32, 32), (3, 4, 1, 64, 48), (17, 8, 2, 32, 48)]  # (tokens, experts, top_k, hidden, inter)


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", FP8_CASES)
def test_fp8_experts_match_the_dequantized_reference(tokens, experts, top_k, hidden, inter, dtype, poisoned_outputs):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    weights = fp8_moe_weights(experts, hidden, inter, seed=tokens)
    assert weights[0].dtype == FP8 and weights[1].shape == (experts, 2 * inter)
    gate_up, gate_up_scale, down, down_scale = weights
    out = fused_moe(x.to(dtype), logits, gate_up, down, top_k, True, gate_up_scale=gate_up_scale,
                    down_scale=down_scale)
    ref = fp8_reference(x.to(dtype), logits, *weights, top_k, True)
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert rel_err(out, ref) < FP8_F32_REL_ERR, rel_err(out, ref)
        # the CPU path (engine/models/moe/sparse.py) on the same FP8 weights: the same numbers
        weights_k, expert_ids = route(logits, top_k, True)
        cpu_path = combine_experts(x, weights_k, expert_ids, *weights[::2], *weights[1::2])
        assert rel_err(cpu_path, ref) < FP8_F32_REL_ERR, rel_err(cpu_path, ref)
    else:  # fp16 rows, scaled into range as the weight-only path does; h and outputs rounded to fp16
        assert rel_err(out, ref) < 2e-3, rel_err(out, ref)


@torch.no_grad()
@pytest.mark.parametrize("top_k", [1, 2])
def test_fp8_experts_an_idle_expert_and_one_expert_taking_every_token(top_k, poisoned_outputs):
    tokens, experts, hidden, inter = 17, 8, 32, 48
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen)
    weights = fp8_moe_weights(experts, hidden, inter, seed=3)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 5] = -30.0  # idle
    logits[:, 2] = 30.0  # every token's first pick
    _, picks = route(logits, top_k, False)
    assert (picks[:, 0] == 2).all() and not (picks == 5).any()
    gate_up, gate_up_scale, down, down_scale = weights
    out = fused_moe(x, logits, gate_up, down, top_k, False, gate_up_scale=gate_up_scale, down_scale=down_scale)
    assert rel_err(out, fp8_reference(x, logits, *weights, top_k, False)) < FP8_F32_REL_ERR


@torch.no_grad()
def test_fp8_experts_with_ragged_tiles(poisoned_outputs):
    """Output tiles past N (48 of 64 in gate_up: their scales masked), several K tiles, a ragged last one."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 64, generator=gen)
    logits = torch.randn(9, 4, generator=gen)
    weights = fp8_moe_weights(4, 64, 48)
    gate_up, gate_up_scale, down, down_scale = weights
    tiles = (MoeTile(16, 64, 32, 4, 2), MoeTile(16, 32, 32, 4, 2))
    out = fused_moe(x, logits, gate_up, down, 2, True, gate_up_scale=gate_up_scale, down_scale=down_scale,
                    tiles=tiles)
    assert rel_err(out, fp8_reference(x, logits, *weights, 2, True)) < FP8_F32_REL_ERR


@torch.no_grad()
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_the_gemv_path_with_several_k_tiles_a_pick_and_ragged_rows(fp8, poisoned_outputs):
    """Explicit small tiles: three K tiles a pick in both kernels (the last one ragged in gate_up, the
    weight tile read ahead masked past K) and row tiles past N in both (masked rows and scales)."""
    tokens, experts, top_k, hidden, inter = 2, 6, 3, 40, 48
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, expert_ids = route(logits, top_k, True)
    # gate_up: rows 48 of 2 x 32, K 40 in 3 tiles of 16; down: rows 40 of 3 x 16, K 48 in 3 tiles of 16
    tiles = (GemvTile(32, 16, 4), GemvTile(16, 16, 4))
    if fp8:
        gate_up, gate_up_scale, down, down_scale = fp8_moe_weights(experts, hidden, inter)
        out = experts_gemv(x, weights, expert_ids, gate_up, down, gate_up_scale, down_scale, tiles)
        ref = fp8_reference(x, logits, gate_up, gate_up_scale, down, down_scale, top_k, True)
        assert rel_err(out, ref) < FP8_F32_REL_ERR, rel_err(out, ref)
    else:
        gate_up, down = moe_weights(experts, hidden, inter)
        out = experts_gemv(x, weights, expert_ids, gate_up, down, None, None, tiles)
        torch.testing.assert_close(out, torch_path(x, logits, gate_up, down, top_k, True), **F32_TOL)


def test_fp8_experts_without_their_scales_are_refused():
    gate_up, gate_up_scale, down, down_scale = fp8_moe_weights(4, 32, 32)
    x, logits = torch.randn(3, 32), torch.randn(3, 4)
    with pytest.raises(ValueError, match="gate_up_scale"):
        fused_moe(x, logits, gate_up, down, 2, True)
    with pytest.raises(ValueError, match="scale"):
        fused_moe(x, logits, gate_up, down, 2, True, gate_up_scale=gate_up_scale, down_scale=down_scale[:, :16])
    with pytest.raises(ValueError, match="scale"):
        fused_moe(x, logits, *moe_weights(4, 32, 32)[:1], down, 2, True, gate_up_scale=gate_up_scale,
                  down_scale=down_scale)


# ---- GPU: real shapes, bf16 ----

DEV = "cuda"
BF16 = torch.bfloat16
SHAPES = {  # name: (hidden, inter, experts, top_k, renormalize)
    "qwen3-30b-a3b": (2048, 768, 128, 8, True),
    "mixtral-8x7b": (4096, 14336, 8, 2, True),
}
GPU_TOKENS = [1, 4, 16, 64, 256, 2048]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def real_layer(request):
    hidden, inter, experts, top_k, renormalize = SHAPES[request.param]
    gate_up, down = moe_weights(experts, hidden, inter, BF16, DEV, seed=1)
    yield request.param, gate_up, down, top_k, renormalize
    del gate_up, down
    torch.cuda.empty_cache()


def real_inputs(tokens: int, hidden: int, experts: int, seed: int = 0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=DEV).to(BF16)
    logits = (torch.randn(tokens, experts, generator=gen, device=DEV) * 2).to(BF16)
    return x, logits


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", GPU_TOKENS)
def test_real_shapes_against_float32(real_layer, tokens, poisoned_outputs):
    name, gate_up, down, top_k, renormalize = real_layer
    x, logits = real_inputs(tokens, gate_up.shape[2], gate_up.shape[0], seed=tokens)
    out = fused_moe(x, logits, gate_up, down, top_k, renormalize)
    ref = fused_moe_ref(x, logits, gate_up, down, top_k, renormalize)
    assert out.dtype == BF16 and out.shape == x.shape
    assert not out.isnan().any(), "an output the kernels never wrote"
    assert rel_err(out, ref) < 1e-2, f"{name} T={tokens}: relative error {rel_err(out, ref):.2e}"


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [16, 2048])
def test_real_shapes_every_token_on_one_expert(real_layer, tokens, poisoned_outputs):
    """One expert's run spans many blocks; another expert is idle."""
    name, gate_up, down, top_k, renormalize = real_layer
    x, logits = real_inputs(tokens, gate_up.shape[2], gate_up.shape[0], seed=7)
    logits[:, 3] = 40.0
    logits[:, 0] = -40.0
    out = fused_moe(x, logits, gate_up, down, top_k, renormalize)
    ref = fused_moe_ref(x, logits, gate_up, down, top_k, renormalize)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2, f"{name} T={tokens}: relative error {rel_err(out, ref):.2e}"


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 4, 64, 1024])  # GEMV, small grouped, GEMM paths; Qwen's torch align
def test_cuda_graph_replay_equals_eager(real_layer, tokens):
    name, gate_up, down, top_k, renormalize = real_layer
    hidden, experts = gate_up.shape[2], gate_up.shape[0]
    x, logits = real_inputs(tokens, hidden, experts, seed=1)
    static_x, static_logits = x.clone(), logits.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm the allocator outside the capture
        fused_moe(static_x, static_logits, gate_up, down, top_k, renormalize)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(static_x, static_logits, gate_up, down, top_k, renormalize)
    for seed in (2, 3):  # new inputs (a new routing) into the captured buffers
        x, logits = real_inputs(tokens, hidden, experts, seed=seed)
        static_x.copy_(x)
        static_logits.copy_(logits)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, fused_moe(x, logits, gate_up, down, top_k, renormalize)), name


@pytest.fixture(scope="module")
def qwen_fp8_layer():
    """Qwen3-30B-A3B's experts in FP8 on the GPU: (gate_up, gate_up_scale, down, down_scale), top_k, renormalize."""
    hidden, inter, experts, top_k, renormalize = SHAPES["qwen3-30b-a3b"]
    weights = fp8_moe_weights(experts, hidden, inter, device=DEV, seed=2)
    yield weights, top_k, renormalize
    del weights
    torch.cuda.empty_cache()


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 16, 256])  # decode (one block an expert), its edge, the GEMM path
def test_fp8_experts_at_real_shape_against_float32(qwen_fp8_layer, tokens, poisoned_outputs):
    """bf16 rows, FP8 experts (weight-only, scaled into fp16 in registers) against the float32
    reference on the dequantized weights."""
    (gate_up, gate_up_scale, down, down_scale), top_k, renormalize = qwen_fp8_layer
    x, logits = real_inputs(tokens, gate_up.shape[2], gate_up.shape[0], seed=tokens + 5)
    out = fused_moe(x, logits, gate_up, down, top_k, renormalize, gate_up_scale=gate_up_scale, down_scale=down_scale)
    ref = fused_moe_ref(x, logits, gate_up, down, top_k, renormalize, gate_up_scale, down_scale)
    assert out.dtype == BF16 and out.shape == x.shape
    assert not out.isnan().any(), "an output the kernels never wrote"
    assert rel_err(out, ref) < 1e-2, f"FP8 T={tokens}: relative error {rel_err(out, ref):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens, top_k, num_experts", [(1, 8, 128), (16, 8, 128), (512, 8, 128), (2048, 2, 8)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_the_align_kernel_equals_the_torch_align_on_cuda(tokens, top_k, num_experts, block_m):
    gen = torch.Generator(device=DEV).manual_seed(tokens)
    expert_ids = torch.rand(tokens, num_experts, generator=gen, device=DEV).topk(top_k, dim=-1).indices
    got, want = moe_align(expert_ids, num_experts, block_m), moe_align_torch(expert_ids, num_experts, block_m)
    for name, a, b in zip(got._fields[:3], got, want):
        assert torch.equal(a, b), name
    check_alignment(expert_ids, num_experts, block_m)


@pytest.mark.gpu
@torch.no_grad()
@pytest.mark.parametrize("tokens", [1, 40])
def test_sparse_moe_on_cuda_uses_the_kernels(tokens, monkeypatch):
    moe = MoeArgs(8, 2, 48, True)
    layer = SparseMoE(64, moe)
    gen = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(tokens, 64, generator=gen)
    want = layer(x)
    calls = []
    import graphserve.engine.models.moe.sparse as moe_module

    monkeypatch.setattr(moe_module, "fused_moe", lambda *a, **kw: calls.append(1) or fused_moe(*a, **kw))
    layer.to(DEV, BF16)
    got = layer(x.to(DEV, BF16))
    assert calls, "the CUDA path did not go through kernels.moe.fused_moe"
    assert rel_err(got.cpu(), want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("experts, top_k", [(128, 8), (8, 2)])
def test_routing_picks_the_set_cuda_topk_picks(experts, top_k):
    """On CUDA, route_fused picks the experts kernels.moe.route (torch.topk) picks, ties included:
    bf16 logits rounded to a coarse grid, so many tokens have a tie at the k-th place."""
    gen = torch.Generator(device=DEV).manual_seed(experts)
    logits = (torch.randn(4096, experts, device=DEV, generator=gen) * 4).round().to(BF16) / 4
    weights, ids = route_fused(logits, top_k, True)
    want_weights, want_ids = route(logits, top_k, True)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    kth = probs.topk(top_k + 1).values
    assert (kth[:, top_k - 1] == kth[:, top_k]).float().mean() > 0.1  # ties at the boundary are common
    assert torch.equal(ids.sort(dim=-1).values, want_ids.sort(dim=-1).values)
    torch.testing.assert_close(weights.sort(dim=-1).values, want_weights.sort(dim=-1).values, rtol=2e-6, atol=1e-8)
