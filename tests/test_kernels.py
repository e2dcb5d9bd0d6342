"""Triton kernels vs their pure-torch references (CPU: TRITON_INTERPRET=1, set by conftest).

Each wrapper runs on fresh random float32 inputs with its output poisoned (NaN) beforehand; the
references themselves are checked once against a naive dense computation.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
import torch.nn.functional as F
from tensor_checks import rel_err

from graphserve.kernels.prefill_attention import default_prefill_tile
from graphserve.kernels.gemv import GemvTile, default_gemv_tile, gemv, gemv_ref, gemv_rope_store, gemv_rope_store_ref
from graphserve.kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache
from graphserve.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from graphserve.kernels.sampling import greedy_sample, greedy_sample_ref
from graphserve.kernels.host_wait import wait_for_host, wait_for_host_ref
from graphserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref, pick_num_splits
from graphserve.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref, prefill_tile_map
from graphserve.kernels.rope_kv_store import rope_and_store_kv, rope_and_store_kv_ref
from graphserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from graphserve.kernels.kv_store import store_kv, store_kv_ref

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("poisoned_outputs")  # every wrapper's outputs start as NaN / -7


def make_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    return k, v


def make_block_tables(batch: int, max_blocks: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """Random, non-contiguous, non-overlapping blocks (block 0 left to padded rows)."""
    perm = torch.randperm(num_blocks - 1, generator=gen)[: batch * max_blocks] + 1
    return perm.reshape(batch, max_blocks).to(torch.int32)


def gather_dense(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Hkv, D] by walking token by token (independent of the refs' vectorised gather)."""
    block_size = cache.shape[1]
    rows = [cache[int(table_row[i // block_size]), i % block_size] for i in range(length)]
    return torch.stack(rows)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float):
    """q [n, Hq, D], k/v [ctx, Hkv, D]; causal on absolute positions via SDPA."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


# ----------------------------------------------------------------------------- decode attention


def decode_case(gen, batch=3, hq=4, hkv=2, head_dim=64, block_size=16, max_blocks=5, ctx=(1, 37, 70)):
    k_cache, v_cache = make_cache(batch * max_blocks + 3, block_size, hkv, head_dim, gen)
    block_tables = make_block_tables(batch, max_blocks, k_cache.shape[0], gen)
    context_lens = torch.tensor(ctx[:batch], dtype=torch.int32)
    q = torch.randn(batch, hq, head_dim, generator=gen)
    return q, k_cache, v_cache, block_tables, context_lens


def test_decode_ref_matches_dense():
    gen = torch.Generator().manual_seed(0)
    q, k_cache, v_cache, bt, cl = decode_case(gen)
    scale = 0.125
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, scale)
    for b in range(q.shape[0]):
        n = int(cl[b])
        k = gather_dense(k_cache, bt[b], n)
        v = gather_dense(v_cache, bt[b], n)
        dense = dense_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), scale)[0]
        assert rel_err(ref[b], dense) < 1e-5


@pytest.fixture(params=[False, True], ids=["merge_kernel", "fused_merge"])
def fused_merge(request, monkeypatch) -> bool:
    """Decode attention's splits merged by the merge kernel or by the last split to finish
    (kernels/decode_attention.FUSED_MERGE)."""
    monkeypatch.setattr(importlib.import_module("graphserve.kernels.decode_attention"), "FUSED_MERGE", request.param)
    return request.param


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_attention(num_splits, fused_merge, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, bt, cl = decode_case(gen)
    if num_splits is None:  # the automatic choice, made to split this small cache
        monkeypatch.setattr("graphserve.kernels.decode_attention._MIN_TOKENS_PER_SPLIT", 16)
        assert pick_num_splits(q.shape[0], k_cache.shape[2], bt.shape[1] * k_cache.shape[1], 132) > 1
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=num_splits, out=out)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 0.125)
    assert rel_err(out, ref) < TOL


def test_decode_attention_row_amax_is_each_kv_groups_largest_stored_value():
    """row_amax (layers.FP8_ATTENTION_AMAX): with one split, the output as AmaxedRows [B, Hq * D], the
    very values of the plain call, and per row and KV head the largest |value| of its query heads; with
    more splits (the partials' merge writes the output) the plain output."""
    from graphserve.kernels.fp8_quant import AmaxedRows

    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, bt, cl = decode_case(gen)
    plain = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=1)
    got = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=1, row_amax=True)
    assert isinstance(got, AmaxedRows)
    batch, heads, dim = q.shape
    assert torch.equal(got.rows, plain.view(batch, heads * dim))
    groups = plain.view(batch, k_cache.shape[2], -1).abs().amax(-1)
    assert torch.equal(got.part_amax, groups)
    split = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=3, row_amax=True)
    assert isinstance(split, torch.Tensor)


@pytest.mark.parametrize("num_splits", [8, 20])
def test_decode_attention_more_splits_than_tiles(num_splits, fused_merge):
    # more splits than KV tiles: most partitions are empty and must be neutral; 20 > one merge chunk
    gen = torch.Generator().manual_seed(2)
    q, k_cache, v_cache, bt, cl = decode_case(gen, batch=2, ctx=(70, 5))
    out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=num_splits)
    assert rel_err(out, paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 0.125)) < TOL


def test_decode_attention_gqa8_head128_block32_strided_q():
    gen = torch.Generator().manual_seed(3)
    _, k_cache, v_cache, bt, cl = decode_case(gen, batch=2, hq=8, hkv=1, head_dim=128, block_size=32,
                                              max_blocks=3, ctx=(65, 33))
    # q as a view of a fused qkv projection, as the engine produces it
    qkv = torch.randn(2, (8 + 2) * 128, generator=gen)
    q = qkv[:, : 8 * 128].view(2, 8, 128)
    out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 128**-0.5, num_splits=2)
    assert rel_err(out, paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 128**-0.5)) < TOL


def test_decode_attention_padded_rows(fused_merge):
    # CUDA-graph padding: rows with context_len 1 pointing at block 0 must not crash or leak NaN
    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, bt, cl = decode_case(gen, ctx=(50, 1, 1))
    bt[1:] = 0
    for splits in (1, 4, 4):  # twice with 4 splits: the fused merge's counters are back at 0
        out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=splits)
        assert torch.isfinite(out).all()
        assert rel_err(out, paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 0.125)) < TOL


def test_pick_num_splits_depends_on_shapes_only():
    assert pick_num_splits(64, 8, 4096, 132) == 1  # 512 programs already fill 132 SMs
    assert pick_num_splits(8, 8, 8192, 132) == 8
    assert pick_num_splits(1, 8, 32768, 132) == 64  # capped at 64 splits
    assert pick_num_splits(1, 8, 128, 132) == 1  # too short to split
    assert pick_num_splits(1, 2, 448, 132) == 3  # capped at 128 tokens per split
    assert pick_num_splits(4, 2, 2048, 132) == 16
    # a batch counts as its decode graph bucket: an eager step splits as the graph would
    assert pick_num_splits(3, 8, 32768, 132) == pick_num_splits(4, 8, 32768, 132) == 16
    assert pick_num_splits(17, 2, 32768, 132) == pick_num_splits(24, 2, 32768, 132) == 11
    assert pick_num_splits(5, 8, 32768, 132) != pick_num_splits(4, 8, 32768, 132)


# ----------------------------------------------------------------------------- prefill attention


def prefill_case(gen, q_lens, ctx_lens, hq=4, hkv=2, head_dim=64, block_size=16):
    max_blocks = max(-(-c // block_size) for c in ctx_lens)
    batch = len(q_lens)
    k_cache, v_cache = make_cache(batch * max_blocks + 2, block_size, hkv, head_dim, gen)
    block_tables = make_block_tables(batch, max_blocks, k_cache.shape[0], gen)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, head_dim, generator=gen)
    return q, k_cache, v_cache, block_tables, cu, torch.tensor(ctx_lens, dtype=torch.int32)


# (q_lens, context_lens): fresh prompts, a cached prefix, a chunk mid-sequence, a single token
PREFILL_CASES = [
    ((20, 70, 1), (20, 70, 1)),
    ((5, 33, 1), (40, 70, 33)),
]


def test_prefill_ref_matches_dense():
    gen = torch.Generator().manual_seed(5)
    q_lens, ctx_lens = PREFILL_CASES[1]
    q, k_cache, v_cache, bt, cu, cl = prefill_case(gen, q_lens, ctx_lens)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125)
    for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
        s = int(cu[b])
        k = gather_dense(k_cache, bt[b], ctx)
        v = gather_dense(v_cache, bt[b], ctx)
        dense = dense_attention(q[s : s + n], k, v, torch.arange(ctx - n, ctx), 0.125)
        assert rel_err(ref[s : s + n], dense) < 1e-5


@pytest.mark.parametrize("q_lens,ctx_lens", PREFILL_CASES)
def test_prefill_attention(q_lens, ctx_lens):
    gen = torch.Generator().manual_seed(6)
    q, k_cache, v_cache, bt, cu, cl = prefill_case(gen, q_lens, ctx_lens)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125, out=out)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125)
    assert rel_err(out, ref) < TOL


def test_prefill_tile_map():
    tiles = prefill_tile_map(np.array([20, 0, 70, 1]), 32, num_tiles=8)
    assert tiles.tolist() == [[0, 2, 2, 2, 3, -1, -1, -1], [0, 0, 1, 2, 0, -1, -1, -1]]
    with pytest.raises(ValueError):
        prefill_tile_map(np.array([70]), 32, num_tiles=2)


def test_prefill_attention_tile_map_with_padding():
    """The shape a prefill CUDA graph launches: tokens past the real ones, sequences with no
    queries and no context, tiles with no sequence. Real rows match the reference; padded
    rows are never written."""
    gen = torch.Generator().manual_seed(8)
    q_lens, ctx_lens = (5, 33, 1), (40, 70, 33)
    q, k_cache, v_cache, bt, cu, cl = prefill_case(gen, q_lens, ctx_lens)
    real = int(cu[-1])
    pad_tokens, pad_seqs = 9, 2
    q_pad = torch.cat([q, torch.randn(pad_tokens, *q.shape[1:], generator=gen)])
    cu_pad = torch.cat([cu, torch.full((pad_seqs,), real, dtype=torch.int32)])
    cl_pad = torch.cat([cl, torch.zeros(pad_seqs, dtype=torch.int32)])
    bt_pad = torch.cat([bt, torch.zeros(pad_seqs, bt.shape[1], dtype=bt.dtype)])
    block_m = default_prefill_tile(64, q.dtype).block_m
    tiles = torch.from_numpy(prefill_tile_map(np.array(q_lens), block_m, num_tiles=real // block_m + 5 + pad_seqs))
    out = torch.full_like(q_pad, float("nan"))
    paged_prefill_attention(q_pad, k_cache, v_cache, bt_pad, cu_pad, cl_pad, 0, 0.125, out=out, tiles=tiles)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125)
    assert rel_err(out[:real], ref) < TOL
    assert out[real:].isnan().all()


def test_prefill_attention_head128_gqa4():
    gen = torch.Generator().manual_seed(7)
    q_lens, ctx_lens = (9, 3), (40, 3)
    q, k_cache, v_cache, bt, cu, cl = prefill_case(gen, q_lens, ctx_lens, hq=4, hkv=1, head_dim=128,
                                                   block_size=32)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 128**-0.5)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 128**-0.5)
    assert rel_err(out, ref) < TOL


# ----------------------------------------------------------------------------- kv store


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv(slot_dtype):
    gen = torch.Generator().manual_seed(8)
    num_blocks, block_size, hkv, head_dim, tokens = 6, 16, 2, 64, 7
    k_cache, v_cache = make_cache(num_blocks, block_size, hkv, head_dim, gen)
    # k and v as strided views of one fused projection output
    kv = torch.randn(tokens, 2 * hkv * head_dim, generator=gen)
    k = kv[:, : hkv * head_dim].view(tokens, hkv, head_dim)
    v = kv[:, hkv * head_dim :].view(tokens, hkv, head_dim)
    slots = torch.tensor([17, -1, 0, 95, 40, -1, 63], dtype=slot_dtype)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, ref_k, ref_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_store_kv_skip_slots_leave_cache_untouched():
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache = make_cache(3, 16, 2, 32, gen)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(4, 2, 32, generator=gen)
    store_kv(k, k.clone(), k_cache, v_cache, torch.full((4,), -1, dtype=torch.int64))
    assert torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)


def test_store_kv_ref_writes_expected_slot():
    k_cache, v_cache = torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)
    k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    store_kv_ref(k, -k, k_cache, v_cache, torch.tensor([6, -1]))
    assert k_cache[1, 2, 0].tolist() == [1.0, 2.0] and v_cache[1, 2, 0].tolist() == [-1.0, -2.0]
    assert k_cache.abs().sum() == 3.0


# ----------------------------------------------------------------------------- rmsnorm


def test_rms_norm():
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(5, 300, generator=gen)  # hidden not a power of two
    w = torch.randn(300, generator=gen)
    ref = rms_norm_ref(x, w, 1e-6)
    dense = w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert rel_err(ref, dense) < 1e-6
    assert rel_err(rms_norm(x, w, 1e-6), ref) < TOL


def test_fused_add_rms_norm():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 256, generator=gen)
    res = torch.randn(5, 256, generator=gen)
    w = torch.randn(256, generator=gen)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    assert torch.equal(x, x0) and torch.equal(res, res0)
    assert rel_err(new_res, x + res) < 1e-7
    assert rel_err(new_res, ref_res) < TOL and rel_err(normed, ref_normed) < TOL


def test_rms_norm_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(12)
    layer = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(3, 64, generator=gen)
    assert torch.equal(rms_norm_ref(x, layer.weight.data, 1e-5), layer(x).detach())


# ----------------------------------------------------------------------------- rotary

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_apply_rotary_in_place():
    gen = torch.Generator().manual_seed(13)
    cache = build_cos_sin_cache(64, 200, 10000.0, None)
    qkv = torch.randn(6, (4 + 2 + 2) * 64, generator=gen)
    q = qkv[:, : 4 * 64].view(6, 4, 64)
    k = qkv[:, 4 * 64 : 6 * 64].view(6, 2, 64)
    v_before = qkv[:, 6 * 64 :].clone()
    positions = torch.tensor([0, 1, 5, 77, 199, 3])
    ref_q, ref_k = apply_rotary_ref(q, k, positions, cache)
    out_q, out_k = apply_rotary(q, k, positions, cache)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert rel_err(q, ref_q) < TOL and rel_err(k, ref_k) < TOL
    assert torch.equal(qkv[:, 6 * 64 :], v_before)


def test_apply_rotary_ref_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(14)
    cache = build_cos_sin_cache(32, 50, 10000.0, None)
    q = torch.randn(5, 4, 32, generator=gen)
    k = torch.randn(5, 2, 32, generator=gen)
    pos = torch.tensor([0, 3, 9, 49, 1])
    cos = torch.cat([cache[pos, :16]] * 2, dim=-1)
    sin = torch.cat([cache[pos, 16:]] * 2, dim=-1)
    # transformers wants [batch, heads, seq, dim]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    ref_q, ref_k = apply_rotary_ref(q, k, pos, cache)
    assert torch.equal(ref_q, hf_q[0].transpose(0, 1)) and torch.equal(ref_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING, {"rope_type": "linear", "factor": 4.0}])
def test_cos_sin_cache_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta = 128, 500000.0
    rope_parameters = {"rope_type": "default", "rope_theta": theta} if scaling is None else {
        **scaling, "rope_theta": theta}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, rope_parameters=rope_parameters)
    rope = LlamaRotaryEmbedding(config)
    positions = torch.tensor([[0, 1, 17, 1000, 4095]])
    cos, sin = rope(torch.zeros(1, dtype=torch.float32), positions)
    cache = build_cos_sin_cache(head_dim, 4096, theta, scaling)
    half = head_dim // 2
    assert torch.equal(cache[positions[0], :half], cos[0, :, :half])
    assert torch.equal(cache[positions[0], half:], sin[0, :, :half])


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_and_store_kv(qk_norm):
    """qk_norm: Qwen3's per-head norms of q and k run in the same kernel, before the rotation."""
    gen = torch.Generator().manual_seed(16)
    tokens, hq, hkv, head_dim = 5, 4, 2, 64
    norms = None
    if qk_norm:
        norms = (1 + torch.randn(head_dim, generator=gen), 1 + torch.randn(head_dim, generator=gen), 1e-6)
    cache = build_cos_sin_cache(head_dim, 100, 10000.0, LLAMA3_SCALING)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * head_dim, generator=gen)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    v = qkv[:, (hq + hkv) * head_dim :].view(tokens, hkv, head_dim)
    k_cache, v_cache = make_cache(4, 16, hkv, head_dim, gen)
    positions = torch.tensor([3, 0, 99, 42, 7])
    slots = torch.tensor([5, -1, 63, 16, 0])
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    qkv *= 3 + torch.arange(tokens)[:, None]  # rows of different scales: a norm that is skipped shows
    ref_q, k_before = q.clone(), k.clone()
    rope_and_store_kv_ref(ref_q, k.clone(), v, positions, cache, ref_k_cache, ref_v_cache, slots, qk_norm=norms)
    rope_and_store_kv(q, k, v, positions, cache, k_cache, v_cache, slots, qk_norm=norms)
    assert rel_err(q, ref_q) < TOL
    assert torch.equal(k, k_before)
    assert rel_err(k_cache, ref_k_cache) < TOL and torch.equal(v_cache, ref_v_cache)
    untouched = torch.ones(4 * 16, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(k_cache.view(64, hkv, head_dim)[untouched], ref_k_cache.view(64, hkv, head_dim)[untouched])


# ----------------------------------------------------------------------------- activation


def test_silu_and_mul():
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(4, 2 * 1500, generator=gen) * 4  # I not a power of two, several column blocks
    ref = silu_and_mul_ref(x)
    dense = x[:, :1500] * torch.sigmoid(x[:, :1500]) * x[:, 1500:]
    assert rel_err(ref, dense) < 1e-6
    assert rel_err(silu_and_mul(x), ref) < TOL


# ----------------------------------------------------------------------------- gemv


def _gemv_case(rows: int, n: int, k: int, seed: int, strided: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + (3 if strided else 0), generator=gen)[:, :k]
    return gen, x, torch.randn(n, k, generator=gen) / k**0.5


@pytest.fixture(params=[0, 1 << 20], ids=["k-runtime", "k-compiled"])
def gemv_k(request, monkeypatch):
    """The GEMV with K a run-time argument or compiled in (kernels.gemv.K_CONSTEXPR_MAX_K)."""
    monkeypatch.setattr(importlib.import_module("graphserve.kernels.gemv"), "K_CONSTEXPR_MAX_K", request.param)
    return request.param


def test_gemv_ref_matches_unfused_decoder_path():
    gen, x, w = _gemv_case(3, 40, 24, seed=20)
    res = torch.randn(3, 24, generator=gen)
    g = torch.randn(24, generator=gen)
    out, new_res = gemv_ref(x, w, norm_weight=g, residual=res, eps=1e-5, silu_mul=True)
    h = (x + res) * torch.rsqrt((x + res).pow(2).mean(-1, keepdim=True) + 1e-5) * g
    y = h @ w.T
    assert rel_err(new_res, x + res) < 1e-7
    assert rel_err(out, F.silu(y[:, :20]) * y[:, 20:]) < 1e-5


@pytest.mark.parametrize("rows,n,k", [(1, 37, 200), (3, 64, 96), (4, 130, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv(rows, n, k, bias):
    gen, x, w = _gemv_case(rows, n, k, seed=21 + rows, strided=rows == 3)
    b = torch.randn(n, generator=gen) if bias else None
    out, new_res = gemv(x, w, b)
    assert new_res is None and out.shape == (rows, n)
    assert rel_err(out, gemv_ref(x, w, b)[0]) < TOL


@pytest.mark.parametrize("long_k_block", [1024, 2048])
def test_gemv_long_k_default_tile(long_k_block, monkeypatch):
    """A down_proj-like K past 4096 takes one row a program with LONG_K_BLOCK_K-wide tiles (the last
    one masked)."""
    gemv_module = importlib.import_module("graphserve.kernels.gemv")
    monkeypatch.setattr(gemv_module, "LONG_K_BLOCK_K", long_k_block)
    assert gemv_module.default_gemv_tile(1, 8, 4864, 132) == gemv_module.GemvTile(1, long_k_block, 8)
    _, x, w = _gemv_case(1, 8, 4864, seed=27)
    out, _ = gemv(x, w)
    assert rel_err(out, gemv_ref(x, w)[0]) < TOL


@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_fused_norm(with_residual, gemv_k):
    gen, x, w = _gemv_case(2, 48, 300, seed=25)  # K not a power of two, several K tiles below
    res = torch.randn(2, 300, generator=gen) if with_residual else None
    g = torch.randn(300, generator=gen)
    x0 = x.clone()
    out, new_res = gemv(x, w, norm_weight=g, residual=res, eps=1e-6, tile=GemvTile(16, 64, 4))
    ref, ref_res = gemv_ref(x, w, norm_weight=g, residual=res, eps=1e-6)
    assert torch.equal(x, x0)
    assert rel_err(out, ref) < TOL
    assert (new_res is None) == (not with_residual)
    if with_residual:
        assert torch.equal(new_res, ref_res)


def test_gemv_fused_norm_silu_mul_float32_logits_dtype(gemv_k):
    gen, x, w = _gemv_case(2, 2 * 72, 128, seed=26)
    res = torch.randn(2, 128, generator=gen)
    g = torch.randn(128, generator=gen)
    out, new_res = gemv(x, w, norm_weight=g, residual=res, silu_mul=True, tile=GemvTile(8, 32, 2))
    ref, ref_res = gemv_ref(x, w, norm_weight=g, residual=res, silu_mul=True)
    assert out.shape == (2, 72) and torch.equal(new_res, ref_res)
    assert rel_err(out, ref) < TOL
    logits, _ = gemv(x.to(torch.float16), w.to(torch.float16), out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert rel_err(logits, gemv_ref(x.to(torch.float16), w.to(torch.float16))[0].float()) < 1e-2


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    return (w / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("silu_mul", [False, True])
def test_gemv_fp8_weights_dequantized_in_registers(silu_mul, gemv_k):
    """FP8 rows times their scale: the dequantized weight's product, over several K tiles (the next
    tile read ahead of its use), with the fused norm and SiLU-and-mul."""
    gen, x, w = _gemv_case(2, 2 * 40 if silu_mul else 40, 300, seed=28)
    w = w * torch.logspace(-2, 1, w.shape[0])[:, None]  # rows of different sizes: the scales matter
    q, scale = _fp8(w)
    res = torch.randn(2, 300, generator=gen)
    g = torch.randn(300, generator=gen)
    out, new_res = gemv(x, q, norm_weight=g, residual=res, silu_mul=silu_mul, weight_scale=scale,
                        tile=GemvTile(8, 64, 4))
    ref, ref_res = gemv_ref(x, q, norm_weight=g, residual=res, silu_mul=silu_mul, weight_scale=scale)
    assert torch.equal(new_res, ref_res)
    assert rel_err(out, ref) < TOL
    unscaled, _ = gemv_ref(x, q.float(), norm_weight=g, residual=res, silu_mul=silu_mul)
    assert rel_err(out, unscaled) > 0.5  # the scales were applied
    with pytest.raises(ValueError):
        gemv(x, q, weight_scale=scale[:-1])


def test_gemv_rope_store_fp8_weights(gemv_k):
    gen = torch.Generator().manual_seed(32)
    hq, hkv, head_dim, hidden, rows = 4, 2, 16, 40, 2
    n = (hq + 2 * hkv) * head_dim
    x, res, g = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen), torch.randn(hidden)
    q8, scale = _fp8(torch.randn(n, hidden, generator=gen) * torch.logspace(-2, 1, n)[:, None])
    b = torch.randn(n, generator=gen)
    cos_sin = build_cos_sin_cache(head_dim, 64, 10000.0, None)
    positions, slots = torch.tensor([5, 40]), torch.tensor([9, 30])
    caches = [torch.zeros(4, 8, hkv, head_dim) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q, new_res = gemv_rope_store(x, q8, b, positions, cos_sin, slots, *caches, hq, norm_weight=g, residual=res,
                                 weight_scale=scale, tile=GemvTile(4, 16, 2))
    ref_q, ref_res = gemv_rope_store_ref(x, q8, b, positions, cos_sin, slots, *ref_caches, hq, norm_weight=g,
                                         residual=res, weight_scale=scale)
    assert torch.equal(new_res, ref_res)
    assert rel_err(q, ref_q) < TOL
    assert rel_err(caches[0], ref_caches[0]) < TOL and rel_err(caches[1], ref_caches[1]) < TOL


def test_gemv_bad_shapes():
    _, x, w = _gemv_case(2, 8, 16, seed=27)
    with pytest.raises(ValueError):
        gemv(x, w[:, :8])
    with pytest.raises(ValueError):
        gemv(x, w[:7], silu_mul=True)
    with pytest.raises(ValueError):
        gemv(x, w, residual=x)


def test_default_gemv_tile_fills_the_gpu_and_bounds_registers():
    for rows, n, k, silu in [(1, 1152, 896, False), (1, 4864, 896, True), (1, 896, 4864, False),
                             (1, 151936, 896, False), (4, 28672 // 2, 4096, True), (8, 4096, 14336, False),
                             (1, 6144, 4096, False), (1, 4096, 14336, False)]:
        for weight_bytes in (2, 1):
            t = default_gemv_tile(rows, n, k, 132, silu, weight_bytes)
            programs = rows * -(-n // t.block_n)
            assert programs >= 2 * 132 or t.block_n == 1
            assert t.block_k <= triton.next_power_of_2(k)
            # fp32 accumulators and the weight tile stay within 64 values a thread
            assert t.block_n * t.block_k * (2 if silu else 1) <= t.num_warps * 32 * 64


# ----------------------------------------------------------------------------- greedy sampling


@pytest.fixture(params=[(4096, False), (1024, False), (4096, True), (1024, True)],
                ids=["chunks-4096", "chunks-1024", "chunks-4096-fused", "chunks-1024-fused"])
def greedy_variant(request, monkeypatch):
    """graphserve.kernels.sampling's CHUNK and FUSED_MERGE (the row's last chunk merges, in one kernel)."""
    module = importlib.import_module("graphserve.kernels.sampling")
    monkeypatch.setattr(module, "CHUNK", request.param[0])
    monkeypatch.setattr(module, "FUSED_MERGE", request.param[1])
    return request.param


def test_greedy_sample(greedy_variant):
    gen = torch.Generator().manual_seed(30)
    logits = torch.randn(4, 10_000, generator=gen) * 3  # several chunks, the last one partial
    logits[1, 9_999] = 50.0  # the maximum in the last, partial chunk
    logits[2, 7] = logits[2, 8_500] = 40.0  # a tie across chunks: the lower index wins
    logits[3, :6_000] = float("-inf")  # banned tokens, whole chunks of them
    tokens, logprobs = greedy_sample(logits)
    ref_tokens, ref_logprobs = greedy_sample_ref(logits)
    assert tokens.tolist() == ref_tokens.tolist() and tokens[1] == 9_999 and tokens[2] == 7
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-5)
    tokens16, logprobs16 = greedy_sample(logits.to(torch.bfloat16))
    ref16 = greedy_sample_ref(logits.to(torch.bfloat16))
    assert tokens16.tolist() == ref16[0].tolist() and torch.allclose(logprobs16, ref16[1], atol=1e-4)


def test_greedy_sample_refuses_a_chunk_its_loop_cannot_step(monkeypatch):
    """graphserve.kernels.sampling.CHUNK (an A/B switch) must be a whole number of the loop's 1024-wide blocks:
    512 would have each program read into the next one's chunk and count those logits twice."""
    monkeypatch.setattr(importlib.import_module("graphserve.kernels.sampling"), "CHUNK", 512)
    with pytest.raises(ValueError):
        greedy_sample(torch.randn(2, 3000))


def test_greedy_sample_with_a_bitmask_picks_the_best_allowed_token(greedy_variant):
    """A grammar's bitmask: the argmax over allowed tokens only (even when they are -inf or the
    row's overall maximum is banned); the logprob is still the model's over the whole vocabulary."""
    gen = torch.Generator().manual_seed(33)
    vocab = 10_003  # a partial last word and a partial last chunk
    logits = torch.randn(4, vocab, generator=gen) * 3
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, -(-vocab // 32)), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # everything allowed: the plain argmax
    bitmask[1] = 0
    bitmask[1, 9_999 // 32] = 1 << (9_999 % 32)  # one token allowed, in the last chunk
    logits[2, 123] = 90.0  # the row's maximum, banned
    bitmask[2, 123 // 32] &= ~(1 << (123 % 32))
    bitmask[3] = 0
    bitmask[3, 0] = 0b1100  # tokens 2 and 3 allowed, both -inf: the first allowed one
    logits[3, 2:4] = float("-inf")
    ref_tokens, ref_logprobs = greedy_sample_ref(logits, bitmask)
    for _ in range(2):  # twice: the fused merge's counters are back at 0
        tokens, logprobs = greedy_sample(logits, bitmask)
        assert tokens[:3].tolist() == ref_tokens[:3].tolist()
        assert tokens[0] == logits[0].argmax() and tokens[1] == 9_999 and tokens[2] != 123 and tokens[3] == 2
        assert torch.allclose(logprobs[:3], ref_logprobs[:3], atol=1e-5)
        assert logprobs[3] == float("-inf")


@pytest.mark.parametrize("hidden", [100, 2500], ids=["one-block", "three-blocks"])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_embedding(hidden, id_dtype, poisoned_outputs):
    """kernels/embedding.py: the table's rows, bit for bit, in the table's dtype; ids past the table
    are clamped to it, never read out of bounds."""
    from graphserve.kernels.embedding import embedding, embedding_ref

    gen = torch.Generator().manual_seed(hidden)
    weight = torch.randn(300, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 299, 17, 17, 150], dtype=id_dtype)
    assert torch.equal(embedding(ids, weight), embedding_ref(ids.long(), weight))
    assert torch.equal(embedding(torch.tensor([-5, 300, 10**6], dtype=id_dtype), weight), weight[[0, 299, 299]])
    assert embedding(ids[:0], weight).shape == (0, hidden)


def test_the_embedding_lookup_on_the_triton_path_is_the_tables_rows(monkeypatch):
    """engine/models/layers.embed with PDL_EMBEDDING, as CUDA runs it (here in the interpreter): the
    kernel's rows; off, torch's lookup."""
    from graphserve.engine.models import layers
    module = importlib.import_module("graphserve.kernels.embedding")

    calls = []
    kernel = module.embedding
    monkeypatch.setattr(module, "embedding", lambda ids, weight: calls.append(ids) or kernel(ids, weight))
    monkeypatch.setattr(layers, "_triton", lambda x: True)
    weight = torch.randn(50, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([3, 49, 0])
    for on in (False, True):
        monkeypatch.setattr(layers, "PDL_EMBEDDING", on)
        assert torch.equal(layers.embed(ids, weight), F.embedding(ids, weight))
        assert len(calls) == on


def test_wait_for_host_returns_once_the_counter_is_reached_and_counts_a_timeout():
    counter = torch.tensor([5], dtype=torch.int64)
    timeouts = torch.zeros(1, dtype=torch.int32)
    for expected in (3, 5):  # reached: no timeout
        wait_for_host(counter, timeouts, expected, max_spins=10)
    assert timeouts.item() == 0
    wait_for_host(counter, timeouts, 6, max_spins=10)  # never reached: gives up, counted
    assert timeouts.item() == 1
    ref_timeouts = torch.zeros(1, dtype=torch.int32)
    for expected in (3, 5, 6):
        wait_for_host_ref(counter, ref_timeouts, expected)
    assert torch.equal(timeouts, ref_timeouts)
    with pytest.raises(ValueError):
        wait_for_host(counter.int(), timeouts, 1)


@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_rope_store(with_bias):
    """Fused norm + qkv projection + rotary + KV-cache write = gemv_ref, rotary, store_kv (refs)."""
    gen = torch.Generator().manual_seed(31)
    hq, hkv, head_dim, hidden, rows = 4, 2, 16, 40, 3
    n = (hq + 2 * hkv) * head_dim
    x = torch.randn(rows, hidden, generator=gen)
    res = torch.randn(rows, hidden, generator=gen)
    g = torch.randn(hidden, generator=gen)
    w = torch.randn(n, hidden, generator=gen) / hidden**0.5
    b = torch.randn(n, generator=gen) if with_bias else None
    cos_sin = build_cos_sin_cache(head_dim, 64, 10000.0, None)
    positions = torch.tensor([5, 63, 17])
    slots = torch.tensor([9, -1, 30])  # the second row writes nothing
    caches = [torch.randn(4, 8, hkv, head_dim, generator=gen) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    q, new_res = gemv_rope_store(x, w, b, positions, cos_sin, slots, *caches, hq, norm_weight=g, residual=res,
                                 tile=None if with_bias else GemvTile(4, 16, 2))
    ref_q, ref_res = gemv_rope_store_ref(x, w, b, positions, cos_sin, slots, *ref_caches, hq, norm_weight=g,
                                         residual=res)
    assert q.shape == (rows, hq, head_dim) and torch.equal(new_res, ref_res)
    assert rel_err(q, ref_q) < TOL
    assert rel_err(caches[0], ref_caches[0]) < TOL and rel_err(caches[1], ref_caches[1]) < TOL
    written = torch.zeros(4 * 8, dtype=torch.bool)
    written[[9, 30]] = True
    for c, before in zip(caches, [ref_caches[0], ref_caches[1]]):  # untouched slots stay as they were
        assert torch.equal(c.view(32, -1)[~written], before.view(32, -1)[~written])


# ----------------------------------------------------------------------------- sliding windows


@pytest.mark.parametrize("window", [1, 8, 20, 100])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_sliding_window(window, num_splits, fused_merge):
    """A window: each row over its last `window` tokens; the tokens before it are never read (NaN there)."""
    gen = torch.Generator().manual_seed(window)
    q, k_cache, v_cache, bt, cl = decode_case(gen, batch=4, ctx=(1, 8, 37, 70))
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 0.125, window=window)
    for b, n in enumerate(cl.tolist()):
        for t in range(max(0, n - window)):
            k_cache[bt[b, t // 16], t % 16] = float("nan")
            v_cache[bt[b, t // 16], t % 16] = float("nan")
    out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=num_splits, window=window)
    assert rel_err(out, ref) < TOL


def test_decode_attention_ref_window_is_the_last_tokens():
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, bt, cl = decode_case(gen)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 0.125, window=10)
    for b in range(q.shape[0]):
        n = int(cl[b])
        lo = max(0, n - 10)
        k = gather_dense(k_cache, bt[b], n)[lo:]
        v = gather_dense(v_cache, bt[b], n)[lo:]
        assert rel_err(ref[b], dense_attention(q[b:b + 1], k, v, torch.tensor([n - 1 - lo]), 0.125)[0]) < 1e-5


@pytest.mark.parametrize("window", [1, 7, 20, 64])
@pytest.mark.parametrize("q_lens,ctx_lens", PREFILL_CASES + [((70, 40), (130, 40))])
def test_prefill_attention_sliding_window(window, q_lens, ctx_lens):
    """Query at position p over keys p - window < k <= p, for fresh prompts, chunks after a cached prefix
    and tiles whose rows' windows begin in different KV tiles (some rows see nothing in a tile)."""
    gen = torch.Generator().manual_seed(window)
    q, k_cache, v_cache, bt, cu, cl = prefill_case(gen, q_lens, ctx_lens)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125, out=out, window=window)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125, window=window)
    assert rel_err(out, ref) < TOL
    # the reference against a dense computation with the window's mask
    for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
        s = int(cu[b])
        k, v = gather_dense(k_cache, bt[b], ctx), gather_dense(v_cache, bt[b], ctx)
        qs, ks, vs = q[s:s + n].transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
        pos = torch.arange(ctx - n, ctx)[:, None]
        keys = torch.arange(ctx)[None, :]
        mask = (keys <= pos) & (keys > pos - window)
        dense = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=0.125).transpose(0, 1)
        assert rel_err(ref[s:s + n], dense) < 1e-5


# ----------------------------------------------------------------------------- attention sinks (gpt-oss)


def _sinks(gen, heads: int) -> torch.Tensor:
    """Sink logits around the scores' size, one far above them (its head's output nearly 0: the sink
    takes the softmax) and one far below (no effect)."""
    sinks = torch.randn(heads, generator=gen)
    sinks[0], sinks[-1] = 60.0, -60.0
    return sinks


def _softmax_with_sink_ref(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The probabilities of transformers' eager gpt-oss attention: a sink column, dropped after softmax."""
    return torch.softmax(torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1), dim=-1)[..., :-1]


@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_sinks(window, num_splits, fused_merge):
    """Each head's sink logit is one more term of its softmax's denominator, with the splits merged by the
    last split or the merge kernel; the reference against a dense softmax with the sink column."""
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, bt, cl = decode_case(gen, batch=3, hq=4, hkv=2, ctx=(1, 37, 70))
    sinks = _sinks(gen, 4)
    out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.125, num_splits=num_splits, window=window, sinks=sinks)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, cl, 0.125, window=window, sinks=sinks)
    assert rel_err(out, ref) < TOL
    assert ref[:, 0].abs().max() < 1e-6 and rel_err(ref[:, 1:], paged_decode_attention_ref(
        q, k_cache, v_cache, bt, cl, 0.125, window=window)[:, 1:]) > 1e-3  # the sinks matter
    for b in range(q.shape[0]):
        n = int(cl[b])
        lo = max(0, n - window) if window else 0
        k, v = gather_dense(k_cache, bt[b], n)[lo:], gather_dense(v_cache, bt[b], n)[lo:]
        kk, vv = k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)  # [Hq, n, D]
        probs = _softmax_with_sink_ref((q[b][:, None, :] @ kk.transpose(1, 2)) * 0.125, sinks[:, None, None])
        dense = (probs @ vv)[:, 0]
        assert rel_err(ref[b], dense) < 1e-5


@pytest.mark.parametrize("window", [None, 7])
def test_prefill_attention_sinks(window):
    gen = torch.Generator().manual_seed(6)
    q_lens, ctx_lens = (5, 33, 1), (40, 70, 33)
    q, k_cache, v_cache, bt, cu, cl = prefill_case(gen, q_lens, ctx_lens)
    sinks = _sinks(gen, 4)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125, out=out, window=window, sinks=sinks)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, cl, max(q_lens), 0.125, window=window, sinks=sinks)
    assert rel_err(out, ref) < TOL
    for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
        s = int(cu[b])
        k, v = gather_dense(k_cache, bt[b], ctx), gather_dense(v_cache, bt[b], ctx)
        qs, ks, vs = q[s:s + n].transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
        pos, keys = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
        mask = (keys <= pos) & ((keys > pos - window) if window else True)
        scores = (qs @ ks.transpose(1, 2) * 0.125).masked_fill(~mask, float("-inf"))
        dense = (_softmax_with_sink_ref(scores, sinks[:, None, None]) @ vs).transpose(0, 1)
        assert rel_err(ref[s:s + n], dense) < 1e-5
