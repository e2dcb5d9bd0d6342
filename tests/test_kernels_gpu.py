"""Triton kernels at real model shapes in bf16 vs float32 references (CUDA only: `pytest -m gpu`)."""

from __future__ import annotations

import importlib

import pytest
import torch
from tensor_checks import rel_err

from graphserve.kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache

from graphserve.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref

from graphserve.kernels.gemv import gemv, gemv_ref, gemv_rope_store, gemv_rope_store_ref

from graphserve.kernels.sampling import greedy_sample, greedy_sample_ref

from graphserve.kernels.host_wait import wait_for_host

from graphserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref

from graphserve.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

from graphserve.kernels.rope_kv_store import rope_and_store_kv, rope_and_store_kv_ref

from graphserve.kernels.activation import silu_and_mul, silu_and_mul_ref

from graphserve.kernels.kv_store import store_kv, store_kv_ref

TOL = 1e-2
DEV = "cuda"
BF16 = torch.bfloat16

LLAMA_8B = dict(hq=32, hkv=8, head_dim=128)
QWEN_05B = dict(hq=14, hkv=2, head_dim=64)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def paged_setup(batch: int, max_ctx: int, hkv: int, head_dim: int, block_size: int = 16, seed: int = 0):
    """bf16 caches with exactly the blocks the batch needs, handed out in a random order."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    max_blocks = -(-max_ctx // block_size)
    num_blocks = batch * max_blocks + 1  # block 0: the dummy block of padded rows
    k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=DEV, dtype=BF16, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=DEV, dtype=BF16, generator=gen)
    perm = torch.randperm(num_blocks - 1, device=DEV, generator=gen) + 1
    block_tables = perm.reshape(batch, max_blocks).to(torch.int32)
    return k_cache, v_cache, block_tables, gen


def decode_case(batch: int, max_ctx: int, hq: int, hkv: int, head_dim: int, seed: int = 0):
    k_cache, v_cache, block_tables, gen = paged_setup(batch, max_ctx, hkv, head_dim, seed=seed)
    context_lens = torch.randint(1, max_ctx + 1, (batch,), device=DEV, generator=gen, dtype=torch.int32)
    context_lens[0] = max_ctx
    q = torch.randn(batch, hq, head_dim, device=DEV, dtype=BF16, generator=gen)
    return q, k_cache, v_cache, block_tables, context_lens


def decode_ref(q, k_cache, v_cache, block_tables, context_lens):
    scale = q.shape[-1] ** -0.5
    return paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables, context_lens, scale)


def use_attention_prefetch(monkeypatch, tiles: int) -> None:
    """Decode attention prefetches `tiles` KV tiles before its PDL wait, whatever the batch."""
    module = importlib.import_module("graphserve.kernels.decode_attention")
    monkeypatch.setattr(module, "PREFETCH_TILES", tiles)
    monkeypatch.setattr(module, "PREFETCH_MAX_BATCH", 1 << 30)


def use_fused_merge(monkeypatch, on: bool) -> None:
    """Decode attention's splits are merged by the last one to finish (on) or by the merge kernel."""
    monkeypatch.setattr(importlib.import_module("graphserve.kernels.decode_attention"), "FUSED_MERGE", on)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,max_ctx,shape,num_splits",
    [
        (64, 4096, LLAMA_8B, None),
        (64, 4096, LLAMA_8B, 4),
        (1, 32768, LLAMA_8B, None),
        (1, 32768, LLAMA_8B, 1),
        (32, 2048, QWEN_05B, None),
        (3, 8192, QWEN_05B, None),
    ],
)
@pytest.mark.parametrize("prefetch_tiles", [0, 2])
@pytest.mark.parametrize("fused_merge", [False, True])
def test_decode_attention_real_shapes(batch, max_ctx, shape, num_splits, prefetch_tiles, fused_merge, monkeypatch):
    """prefetch_tiles: kernels/decode_attention.PREFETCH_TILES (the KV rows asked of L2 before the PDL
    wait), at every batch here; fused_merge: FUSED_MERGE."""
    use_attention_prefetch(monkeypatch, prefetch_tiles)
    use_fused_merge(monkeypatch, fused_merge)
    q, k_cache, v_cache, bt, cl = decode_case(batch, max_ctx, **shape)
    out = nan_like(q)
    paged_decode_attention(q, k_cache, v_cache, bt, cl, q.shape[-1] ** -0.5, num_splits=num_splits, out=out)
    assert rel_err(out, decode_ref(q, k_cache, v_cache, bt, cl)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN_05B])
def test_decode_attention_row_amax_real_shapes(shape):
    """row_amax (layers.FP8_ATTENTION_AMAX) at 64 rows, one split as the engine picks there: the plain
    call's output bit for bit as [B, Hq * D], and each KV head group's largest |value|."""
    from graphserve.kernels.fp8_quant import AmaxedRows

    q, k_cache, v_cache, bt, cl = decode_case(64, 512, **shape, seed=5)
    scale = q.shape[-1] ** -0.5
    plain = paged_decode_attention(q, k_cache, v_cache, bt, cl, scale, num_splits=1)
    got = paged_decode_attention(q, k_cache, v_cache, bt, cl, scale, num_splits=1, row_amax=True)
    assert isinstance(got, AmaxedRows)
    assert torch.equal(got.rows, plain.view(64, -1))
    assert torch.equal(got.part_amax, plain.view(64, shape["hkv"], -1).abs().amax(-1).float())
    assert rel_err(plain, decode_ref(q, k_cache, v_cache, bt, cl)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [32, 64])
def test_decode_attention_block_sizes(block_size):
    k_cache, v_cache, bt, gen = paged_setup(8, 1000, 8, 128, block_size=block_size)
    cl = torch.tensor([1000, 1, 17, 999, 64, 65, 500, 2], dtype=torch.int32, device=DEV)
    q = torch.randn(8, 32, 128, device=DEV, dtype=BF16, generator=gen)
    out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 128**-0.5)
    assert rel_err(out, decode_ref(q, k_cache, v_cache, bt, cl)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("fused_merge", [False, True])
def test_decode_attention_cuda_graph_replay(fused_merge, monkeypatch):
    """fused_merge: the split counters (kernels/decode_attention.FUSED_MERGE) return to 0 after each
    launch, so every replay merges again."""
    use_fused_merge(monkeypatch, fused_merge)
    batch, max_ctx = 8, 4096
    q, k_cache, v_cache, bt, cl = decode_case(batch, max_ctx, **LLAMA_8B, seed=1)
    cl[4:] = 1  # padded rows of a bucket: context 1 at dummy block 0
    bt[4:] = 0
    scale = 128**-0.5
    out = torch.empty_like(q)

    def step():
        paged_decode_attention(q, k_cache, v_cache, bt, cl, scale, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    gen = torch.Generator(device=DEV).manual_seed(2)
    for _ in range(3):
        cl.copy_(torch.randint(1, max_ctx + 1, (batch,), device=DEV, dtype=torch.int32, generator=gen))
        q.copy_(torch.randn(q.shape, device=DEV, dtype=BF16, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, decode_ref(q, k_cache, v_cache, bt, cl)) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN_05B])
def test_decode_attention_fused_merge_under_repeated_launches(shape, monkeypatch):
    """Many splits finishing at nearly the same time, launch after launch with PDL: the last split
    merges every partial (a stale or missing one would show as an error), 50 launches in a row, each
    equal to the merge kernel's result within float32 reordering."""
    batch, max_ctx = 3, 8192
    q, k_cache, v_cache, bt, cl = decode_case(batch, max_ctx, **shape, seed=4)
    scale = q.shape[-1] ** -0.5
    use_fused_merge(monkeypatch, False)
    expected = paged_decode_attention(q, k_cache, v_cache, bt, cl, scale, num_splits=64).float()
    use_fused_merge(monkeypatch, True)
    outs = [paged_decode_attention(q, k_cache, v_cache, bt, cl, scale, num_splits=64, out=nan_like(q))
            for _ in range(50)]
    for out in outs:
        assert (out.float() - expected).abs().max().item() <= 1e-2 * expected.abs().max().item()
        assert torch.equal(out, outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN_05B])
def test_prefill_attention_mixed_lengths_and_prefixes(shape):
    # (new tokens, cached prefix): fresh prompts, prefix-cache hits, chunked-prefill chunks, one token
    q_lens = [1, 100, 517, 1024, 64, 300]
    prefixes = [0, 50, 0, 1024, 2000, 7]
    ctx_lens = [n + p for n, p in zip(q_lens, prefixes)]
    k_cache, v_cache, bt, gen = paged_setup(len(q_lens), max(ctx_lens), shape["hkv"], shape["head_dim"])
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    cl = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), shape["hq"], shape["head_dim"], device=DEV, dtype=BF16, generator=gen)
    scale = shape["head_dim"] ** -0.5
    out = nan_like(q)
    paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens), scale, out=out)
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, cu, cl, max(q_lens), scale)
    assert rel_err(out, ref) < TOL


# the sliding-window shapes: Gemma 3 12B's local layers, gpt-oss-20b's, Mistral v0.1's
GEMMA3_12B = dict(hq=16, hkv=8, head_dim=256)
GPT_OSS_20B = dict(hq=64, hkv=8, head_dim=64)
WINDOW_CASES = [(GEMMA3_12B, 1024), (GPT_OSS_20B, 128), (LLAMA_8B, 4096)]


def poison_outside_windows(k_cache, v_cache, block_tables, last_positions, window: int, value: float) -> None:
    """`value` in the K and V of every position before each row's window (last_positions: the position
    of each row's first query)."""
    block_size = k_cache.shape[1]
    starts = (torch.as_tensor(last_positions, device=DEV) + 1 - window).clamp(min=0)
    positions = torch.arange(block_tables.shape[1] * block_size, device=DEV)
    rows, before = (positions[None, :] < starts[:, None]).nonzero(as_tuple=True)
    blocks = block_tables[rows, before // block_size].long()
    k_cache[blocks, before % block_size] = value
    v_cache[blocks, before % block_size] = value


@pytest.mark.gpu
@pytest.mark.parametrize("shape,window", WINDOW_CASES, ids=["gemma3-12b", "gpt-oss-20b", "mistral-7b"])
@pytest.mark.parametrize("batch,max_ctx", [(64, 4096), (1, 32768)])
def test_decode_attention_sliding_window_real_shapes(shape, window, batch, max_ctx):
    """Each row over its last `window` tokens, contexts shorter and longer than the window; positions
    before a row's window are NaN in the cache and never read (as on CPU, tests/test_kernels.py)."""
    q, k_cache, v_cache, bt, cl = decode_case(batch, max_ctx, **shape)
    scale = q.shape[-1] ** -0.5
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, cl, scale, window=window)
    poison_outside_windows(k_cache, v_cache, bt, cl - 1, window, float("nan"))
    out = nan_like(q)
    paged_decode_attention(q, k_cache, v_cache, bt, cl, scale, out=out, window=window)
    assert rel_err(out, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape,window", WINDOW_CASES, ids=["gemma3-12b", "gpt-oss-20b", "mistral-7b"])
def test_prefill_attention_sliding_window_real_shapes(shape, window):
    """Fresh prompts longer than the window, chunks after cached prefixes longer than it, one token."""
    q_lens = [1, 100, 517, 1024, 64, 300, 2500]
    prefixes = [5000, 50, 0, 1024, 2000, 7, 0]
    ctx_lens = [n + p for n, p in zip(q_lens, prefixes)]
    k_cache, v_cache, bt, gen = paged_setup(len(q_lens), max(ctx_lens), shape["hkv"], shape["head_dim"])
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    cl = torch.tensor(ctx_lens, dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), shape["hq"], shape["head_dim"], device=DEV, dtype=BF16, generator=gen)
    scale = shape["head_dim"] ** -0.5
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, cu, cl, max(q_lens), scale,
                                      window=window)
    # the first query of each row is at position prefix: keys before prefix + 1 - window weigh nothing (a
    # tile across a window's start is read and masked, so a large finite value rather than NaN)
    poison_outside_windows(k_cache, v_cache, bt, prefixes, window, 3e4)
    out = nan_like(q)
    paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens), scale, out=out, window=window)
    assert rel_err(out, ref) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [LLAMA_8B, QWEN_05B])
def test_prefill_attention_tile_map_padded_like_a_graph(shape):
    """The prefill graphs' launch: a fixed-size tile map, tokens and sequences padded past the
    real ones (prefix-cache tails after long prefixes, one-token chunks). Real rows match the
    reference; padded rows are never written."""
    import numpy as np

    from graphserve.kernels.prefill_attention import prefill_tile_map
    from graphserve.kernels.prefill_attention import default_prefill_tile

    q_lens = [32, 1, 45, 7, 130]
    prefixes = [2000, 64, 1999, 0, 300]
    ctx_lens = [n + p for n, p in zip(q_lens, prefixes)]
    real, bucket, seqs = sum(q_lens), 256, 16
    k_cache, v_cache, bt, gen = paged_setup(seqs, max(ctx_lens), shape["hkv"], shape["head_dim"])
    cu = torch.full((seqs + 1,), real, dtype=torch.int32, device=DEV)
    cu[0] = 0
    cu[1:len(q_lens) + 1] = torch.tensor(q_lens, device=DEV).cumsum(0)
    cl = torch.zeros(seqs, dtype=torch.int32, device=DEV)
    cl[:len(q_lens)] = torch.tensor(ctx_lens, device=DEV)
    block_m = default_prefill_tile(shape["head_dim"], BF16).block_m
    tiles = torch.from_numpy(prefill_tile_map(np.array(q_lens), block_m, -(-bucket // block_m) + seqs)).to(DEV)
    q = torch.randn(bucket, shape["hq"], shape["head_dim"], device=DEV, dtype=BF16, generator=gen)
    scale = shape["head_dim"] ** -0.5
    out = nan_like(q)
    paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, 0, scale, out=out, tiles=tiles)
    n = len(q_lens)
    ref = paged_prefill_attention_ref(q[:real].float(), k_cache.float(), v_cache.float(), bt[:n], cu[:n + 1],
                                      cl[:n], max(q_lens), scale)
    assert rel_err(out[:real], ref) < TOL
    assert out[real:].isnan().all()


@pytest.mark.gpu
def test_store_kv_real_shape():
    k_cache, v_cache, _, gen = paged_setup(4, 1024, 8, 128)
    tokens = 300
    k = torch.randn(tokens, 8, 128, device=DEV, dtype=BF16, generator=gen)
    v = torch.randn(tokens, 8, 128, device=DEV, dtype=BF16, generator=gen)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEV, generator=gen)[:tokens]
    slots[::7] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, ref_k, ref_v, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.gpu
def test_rms_norm_hidden_4096():
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(257, 4096, device=DEV, dtype=BF16, generator=gen)
    res = torch.randn(257, 4096, device=DEV, dtype=BF16, generator=gen)
    w = torch.rand(4096, device=DEV, dtype=BF16, generator=gen) + 0.5
    assert rel_err(rms_norm(x, w, 1e-5), rms_norm_ref(x.float(), w.float(), 1e-5)) < TOL
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    ref_normed, ref_res = fused_add_rms_norm_ref(x.float(), res.float(), w.float(), 1e-5)
    assert rel_err(new_res, ref_res) < TOL and rel_err(normed, ref_normed) < TOL
    # same rounding steps as the bf16 eager reference (HF LlamaRMSNorm): bit-exact up to rsqrt
    assert rel_err(normed, fused_add_rms_norm_ref(x, res, w, 1e-5)[0]) < 1e-3


@pytest.mark.gpu
def test_rotary_llama_8b():
    gen = torch.Generator(device=DEV).manual_seed(4)
    cache = build_cos_sin_cache(128, 131072, 500000.0, LLAMA3_SCALING, device=DEV)
    tokens = 513
    qkv = torch.randn(tokens, (32 + 16) * 128, device=DEV, dtype=BF16, generator=gen)
    q = qkv[:, : 32 * 128].view(tokens, 32, 128)
    k = qkv[:, 32 * 128 : 40 * 128].view(tokens, 8, 128)
    positions = torch.randint(0, 131072, (tokens,), device=DEV, generator=gen)
    ref_q, ref_k = apply_rotary_ref(q.float(), k.float(), positions, cache)
    apply_rotary(q, k, positions, cache)
    assert rel_err(q, ref_q) < TOL and rel_err(k, ref_k) < TOL


@pytest.mark.gpu
def test_silu_and_mul_intermediate_14336():
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(129, 2 * 14336, device=DEV, dtype=BF16, generator=gen) * 3
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x.float())) < TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.float32, 1e-4)])
def test_attention_fp16_fp32(dtype, tol):
    # fp32 must not silently fall back to tf32 tensor-core math
    k_cache, v_cache, bt, gen = paged_setup(4, 700, 8, 128)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    cl = torch.tensor([700, 1, 300, 513], dtype=torch.int32, device=DEV)
    q = torch.randn(4, 32, 128, device=DEV, dtype=dtype, generator=gen)
    for splits in (1, 5):
        out = paged_decode_attention(q, k_cache, v_cache, bt, cl, 128**-0.5, num_splits=splits, out=nan_like(q))
        assert rel_err(out, decode_ref(q, k_cache, v_cache, bt, cl)) < tol
    q_lens = [100, 1, 300, 13]
    cu = torch.zeros(5, dtype=torch.int32, device=DEV)
    cu[1:] = torch.tensor(q_lens, device=DEV).cumsum(0)
    qp = torch.randn(sum(q_lens), 32, 128, device=DEV, dtype=dtype, generator=gen)
    out = paged_prefill_attention(qp, k_cache, v_cache, bt, cu, cl, 300, 128**-0.5, out=nan_like(qp))
    ref = paged_prefill_attention_ref(qp.float(), k_cache.float(), v_cache.float(), bt, cu, cl, 300, 128**-0.5)
    assert rel_err(out, ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["llama-8b", "qwen3-30b-a3b-qk-norm"])
def test_rope_and_store_kv(shape):
    """Llama-3.1-8B's heads; Qwen3-30B-A3B's (32 q, 4 kv) with its per-head q/k norms in the kernel."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    hq, hkv = (32, 8) if shape == "llama-8b" else (32, 4)
    k_cache, v_cache, _, _ = paged_setup(4, 1024, hkv, 128)
    cache = build_cos_sin_cache(128, 131072, 500000.0, LLAMA3_SCALING, device=DEV)
    tokens = 300
    qkv = torch.randn(tokens, (hq + 2 * hkv) * 128, device=DEV, dtype=BF16, generator=gen)
    qkv *= torch.rand(tokens, 1, device=DEV, dtype=BF16, generator=gen) * 8
    q, k, v = (qkv[:, a * 128 : b * 128].view(tokens, b - a, 128)
               for a, b in ((0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)))
    norms = None
    if shape.endswith("qk-norm"):
        norms = tuple(1 + torch.randn(128, device=DEV, dtype=BF16, generator=gen) for _ in range(2)) + (1e-6,)
    positions = torch.randint(0, 131072, (tokens,), device=DEV, generator=gen)
    slots = torch.randperm(k_cache.shape[0] * 16, device=DEV, generator=gen)[:tokens]
    slots[::5] = -1
    ref_q, ref_k_cache, ref_v_cache = q.clone(), k_cache.clone(), v_cache.clone()
    rope_and_store_kv_ref(ref_q, k, v, positions, cache, ref_k_cache, ref_v_cache, slots, qk_norm=norms)
    rope_and_store_kv(q, k, v, positions, cache, k_cache, v_cache, slots, qk_norm=norms)
    # the reference rounds after each bf16 op, the kernel once: they differ by at most one bf16 ulp
    assert rel_err(q, ref_q) < TOL and rel_err(k_cache, ref_k_cache) < TOL
    assert torch.equal(v_cache, ref_v_cache)


# (weight rows N, K, fused norm + residual, bias, silu_mul) of the decode-step projections
GEMV_SHAPES = {
    "qwen-qkv": (1152, 896, True, True, False), "qwen-gate_up": (9728, 896, True, False, True),
    "qwen-down": (896, 4864, False, False, False), "qwen-lm_head": (151936, 896, False, False, False),
    "llama-qkv": (6144, 4096, True, False, False), "llama-o": (4096, 4096, False, False, False),
    "llama-gate_up": (28672, 4096, True, False, True), "llama-down": (4096, 14336, False, False, False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(GEMV_SHAPES) + ["qwen-down-2048", "llama-down-2048"])
def test_gemv_real_shapes(name, rows, poisoned_outputs, monkeypatch):
    """*-2048: down_proj with 2048-wide K tiles (kernels/gemv.LONG_K_BLOCK_K)."""
    if name.endswith("-2048"):
        monkeypatch.setattr(importlib.import_module("graphserve.kernels.gemv"), "LONG_K_BLOCK_K", 2048)
        name = name.removesuffix("-2048")
    n, k, norm, bias, silu = GEMV_SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(rows)
    x = torch.randn(rows, k, device=DEV, dtype=BF16, generator=gen)
    w = torch.randn(n, k, device=DEV, dtype=BF16, generator=gen) / k**0.5
    b = torch.randn(n, device=DEV, dtype=BF16, generator=gen) if bias else None
    res = torch.randn(rows, k, device=DEV, dtype=BF16, generator=gen) if norm else None
    g = torch.rand(k, device=DEV, dtype=BF16, generator=gen) + 0.5 if norm else None
    out_dtype = torch.float32 if "lm_head" in name else None
    out, new_res = gemv(x, w, b, norm_weight=g, residual=res, silu_mul=silu, out_dtype=out_dtype)
    f32 = lambda t: t.float() if t is not None else None
    ref, ref_res = gemv_ref(x.float(), w.float(), f32(b), norm_weight=f32(g), residual=f32(res), silu_mul=silu)
    assert out.dtype == (out_dtype or BF16) and not out.isnan().any()
    assert rel_err(out, ref) < TOL
    if norm:
        assert torch.equal(new_res, (x.float() + res.float()).to(BF16))
    # the unfused bf16 path (same rounding steps, cuBLAS summation order) agrees closely too
    assert rel_err(out, gemv_ref(x, w, b, norm_weight=g, residual=res, silu_mul=silu)[0]) < 5e-3


@pytest.fixture(params=[(4096, False), (1024, True)], ids=["chunks-4096", "chunks-1024-fused"])
def greedy_variant(request, monkeypatch):
    """graphserve.kernels.sampling's CHUNK and FUSED_MERGE (the row's last chunk merges, one PDL kernel)."""
    module = importlib.import_module("graphserve.kernels.sampling")
    monkeypatch.setattr(module, "CHUNK", request.param[0])
    monkeypatch.setattr(module, "FUSED_MERGE", request.param[1])
    return request.param


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 128256])
@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_greedy_sample_real_vocab(vocab, dtype, greedy_variant, poisoned_outputs):
    """Twenty launches in a row (the fused merge's counters return to 0; a chunk merged before it was
    written would show), then under CUDA-graph replay with new logits."""
    gen = torch.Generator(device=DEV).manual_seed(vocab)
    logits = (torch.randn(64, vocab, device=DEV, generator=gen) * 4).to(dtype)
    logits[5, vocab - 1] = 100.0  # the maximum in the last vocabulary entry
    ref_tokens, ref_logprobs = greedy_sample_ref(logits)
    for _ in range(20):
        tokens, logprobs = greedy_sample(logits)
        assert torch.equal(tokens, ref_tokens) and tokens[5] == vocab - 1
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens, logprobs = greedy_sample(logits)
    for _ in range(3):
        logits.copy_((torch.randn(logits.shape, device=DEV, generator=gen) * 4).to(dtype))
        tokens.fill_(-1)
        logprobs.fill_(float("nan"))
        graph.replay()
        ref_tokens, ref_logprobs = greedy_sample_ref(logits)
        assert torch.equal(tokens, ref_tokens)
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,hidden", [(151936, 896), (128256, 4096)], ids=["qwen", "llama"])
def test_embedding_real_shapes(vocab, hidden, poisoned_outputs):
    """kernels/embedding.py at the models' tables: the rows bit for bit, eagerly and under graph replay
    with new ids."""
    from graphserve.kernels.embedding import embedding

    gen = torch.Generator(device=DEV).manual_seed(hidden)
    weight = torch.randn(vocab, hidden, device=DEV, dtype=BF16, generator=gen)
    ids = torch.randint(0, vocab, (64,), device=DEV, generator=gen)
    ids[0] = vocab - 1
    assert torch.equal(embedding(ids, weight), weight[ids])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = embedding(ids, weight)
    ids.copy_(torch.randint(0, vocab, (64,), device=DEV, generator=gen))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, weight[ids])


@pytest.mark.gpu
def test_wait_for_host_holds_the_stream_until_the_host_raises_the_counter():
    """The device waits on page-locked host memory: work queued after the wait runs only once
    another host thread has raised the counter; a wait that is never answered gives up."""
    import threading
    import time

    counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    timeouts = torch.zeros(1, dtype=torch.int32, pin_memory=True)
    out = torch.zeros(1, device=DEV)
    done = torch.cuda.Event()
    wait_for_host(counter, timeouts, 1)
    out.fill_(1.0)
    done.record()
    time.sleep(0.05)
    assert not done.query()  # (reading `out` now would wait for the stream: the host is the one to answer)
    threading.Timer(0.02, lambda: counter.numpy().__setitem__(0, 1)).start()
    started = time.perf_counter()
    done.synchronize()
    assert time.perf_counter() - started >= 0.01 and out.item() == 1.0 and timeouts.item() == 0
    wait_for_host(counter, timeouts, 2, max_spins=1000)  # never answered
    torch.cuda.synchronize()
    assert timeouts.item() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [151936, 128256])
def test_greedy_sample_masked_real_vocab(vocab, greedy_variant, poisoned_outputs):
    gen = torch.Generator(device=DEV).manual_seed(vocab + 1)
    logits = (torch.randn(64, vocab, device=DEV, generator=gen) * 4).to(BF16)
    words = -(-vocab // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (64, words), device=DEV, generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[:8] = 0  # grammar-like rows: a handful of allowed tokens
    for r in range(8):
        allowed = torch.randint(0, vocab, (5,), device=DEV, generator=gen)
        bitmask[r].index_put_((allowed // 32,), (1 << (allowed % 32)).to(torch.int32), accumulate=True)
    bitmask[8:16] = -1
    tokens, logprobs = greedy_sample(logits, bitmask)
    ref_tokens, ref_logprobs = greedy_sample_ref(logits, bitmask)
    assert torch.equal(tokens, ref_tokens)
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,hidden,bias", [(QWEN_05B, 896, True), (LLAMA_8B, 4096, False)], ids=["qwen", "llama"])
def test_gemv_rope_store_real_shapes(shape, hidden, bias, poisoned_outputs):
    hq, hkv, head_dim = shape["hq"], shape["hkv"], shape["head_dim"]
    gen = torch.Generator(device=DEV).manual_seed(hidden)
    n = (hq + 2 * hkv) * head_dim
    x = torch.randn(1, hidden, device=DEV, dtype=BF16, generator=gen)
    res = torch.randn(1, hidden, device=DEV, dtype=BF16, generator=gen)
    g = torch.rand(hidden, device=DEV, dtype=BF16, generator=gen) + 0.5
    w = torch.randn(n, hidden, device=DEV, dtype=BF16, generator=gen) / hidden**0.5
    b = torch.randn(n, device=DEV, dtype=BF16, generator=gen) if bias else None
    cache = build_cos_sin_cache(head_dim, 131072, 500000.0, LLAMA3_SCALING, device=DEV)
    positions = torch.tensor([70000], device=DEV)
    slots = torch.tensor([1234], device=DEV)
    caches = [torch.randn(100, 16, hkv, head_dim, device=DEV, dtype=BF16, generator=gen) for _ in range(2)]
    ref_caches = [c.float() for c in caches]
    q, new_res = gemv_rope_store(x, w, b, positions, cache, slots, *caches, hq, norm_weight=g, residual=res)
    f32 = lambda t: t.float() if t is not None else None
    ref_q, _ = gemv_rope_store_ref(x.float(), w.float(), f32(b), positions, cache, slots, *ref_caches, hq,
                                   norm_weight=g.float(), residual=res.float())
    assert rel_err(q, ref_q) < TOL and torch.equal(new_res, (x.float() + res.float()).to(BF16))
    written = (slots // 16, slots % 16)
    for c, ref in zip(caches, ref_caches):
        assert rel_err(c[written], ref[written]) < TOL
        assert torch.equal(c[0], ref[0].to(BF16))  # other slots untouched


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("name", [n for n in sorted(GEMV_SHAPES) if "lm_head" not in n])
def test_gemv_fp8_weights_real_shapes(name, rows, poisoned_outputs):
    """FP8 weights (e4m3, a float32 scale per row) dequantized in registers: the float32 product
    with the dequantized weight."""
    from graphserve.engine.models.fp8 import quantize_per_channel

    n, k, norm, bias, silu = GEMV_SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(rows + 100)
    x = torch.randn(rows, k, device=DEV, dtype=BF16, generator=gen)
    q, scale = quantize_per_channel(torch.randn(n, k, device=DEV, generator=gen) / k**0.5)
    b = torch.randn(n, device=DEV, dtype=BF16, generator=gen) if bias else None
    res = torch.randn(rows, k, device=DEV, dtype=BF16, generator=gen) if norm else None
    g = torch.rand(k, device=DEV, dtype=BF16, generator=gen) + 0.5 if norm else None
    out, new_res = gemv(x, q, b, norm_weight=g, residual=res, silu_mul=silu, weight_scale=scale)
    f32 = lambda t: t.float() if t is not None else None
    ref, _ = gemv_ref(x.float(), q, f32(b), norm_weight=f32(g), residual=f32(res), silu_mul=silu, weight_scale=scale)
    assert out.dtype == BF16 and not out.isnan().any()
    assert rel_err(out, ref) < TOL
    if norm:
        assert torch.equal(new_res, (x.float() + res.float()).to(BF16))


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch_tiles,fused_merge", [(0, False), (2, False), (2, True)])
def test_programmatic_dependent_launch_keeps_a_chain_of_kernels_in_order(prefetch_tiles, fused_merge, monkeypatch):
    """A decoder-like chain (GEMVs that read what the one before wrote, attention between them)
    captured in a CUDA graph with programmatic dependent launch gives bit for bit what it gives
    launched one by one without it: no kernel reads its input before the kernel before wrote it.
    Every layer writes the same cache slot, which the attention after it reads: with prefetch_tiles
    (decode_attention.PREFETCH_TILES) it asks L2 for that row before its wait, and must still see the
    value the qkv kernel before it wrote. fused_merge: the attention's two splits merge in the last
    one to finish (decode_attention.FUSED_MERGE), before the o_proj GEMV reads the result."""
    from graphserve.kernels import launch_settings

    use_attention_prefetch(monkeypatch, prefetch_tiles)
    use_fused_merge(monkeypatch, fused_merge)

    gen = torch.Generator(device=DEV).manual_seed(7)
    hidden, hq, hkv, head_dim, inter = 896, 14, 2, 64, 4864
    n_qkv = (hq + 2 * hkv) * head_dim
    layers = [dict(qkv=torch.randn(n_qkv, hidden, device=DEV, dtype=BF16, generator=gen) / hidden**0.5,
                   o=torch.randn(hidden, hq * head_dim, device=DEV, dtype=BF16, generator=gen) / hidden**0.5,
                   gate_up=torch.randn(2 * inter, hidden, device=DEV, dtype=BF16, generator=gen) / hidden**0.5,
                   down=torch.randn(hidden, inter, device=DEV, dtype=BF16, generator=gen) / inter**0.5,
                   g1=torch.rand(hidden, device=DEV, dtype=BF16, generator=gen) + 0.5,
                   g2=torch.rand(hidden, device=DEV, dtype=BF16, generator=gen) + 0.5) for _ in range(4)]
    k_cache, v_cache, block_tables, _ = paged_setup(1, 300, hkv, head_dim, seed=3)
    cos_sin = build_cos_sin_cache(head_dim, 4096, 1000000.0, None, device=DEV)
    positions = torch.tensor([299], device=DEV)
    slots = (block_tables[0, 299 // 16].long() * 16 + 299 % 16).view(1)
    lens = torch.tensor([300], device=DEV, dtype=torch.int32)
    x0 = torch.randn(1, hidden, device=DEV, dtype=BF16, generator=gen)

    def chain():
        x, res = x0, torch.zeros_like(x0)
        for w in layers:
            q, res = gemv_rope_store(x, w["qkv"], None, positions, cos_sin, slots, k_cache, v_cache, hq,
                                     norm_weight=w["g1"], residual=res)
            attn = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, num_splits=2)
            x = gemv(attn.view(1, -1), w["o"])[0]
            act, res = gemv(x, w["gate_up"], norm_weight=w["g2"], residual=res, silu_mul=True)
            x = gemv(act, w["down"])[0]
        return x + res

    launch_settings.PDL = False
    try:
        expected = chain()
    finally:
        launch_settings.PDL = True
    assert launch_settings.use_pdl(torch.device(DEV)) == (torch.cuda.get_device_capability()[0] >= 9)
    assert_graph_replays_give(chain, expected)


def assert_graph_replays_give(chain, expected: torch.Tensor) -> None:
    """chain() captured in a CUDA graph (after one run outside it, which compiles) gives `expected`
    bit for bit on each of three replays."""
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)




@pytest.mark.gpu
def test_programmatic_dependent_launch_of_the_kernels_between_projections(monkeypatch):
    """kernels/launch_settings.PDL_ELEMENTWISE: a decoder-like chain at 8 rows (skinny GEMMs, W8A8 among
    them, with the RMSNorm, FP8 quantization, rotary + KV store and SiLU-and-mul kernels between
    them, and decode attention asking L2 for its KV before it waits) captured in a CUDA graph with
    every kernel launched with PDL gives bit for bit what it gives launched one by one without: each
    waits for the kernel before it."""
    from graphserve.kernels import launch_settings
    from graphserve.kernels.fp8_quant import quantize_rows_fp8
    from graphserve.kernels.rmsnorm import rms_norm_fp8
    from graphserve.kernels.skinny_gemm import skinny_gemm

    from graphserve.engine.models.fp8 import quantize_per_channel

    gen = torch.Generator(device=DEV).manual_seed(8)
    rows, hidden, hq, hkv, head_dim, inter = 8, 896, 14, 2, 64, 4864

    def weight(n, k):
        return torch.randn(n, k, device=DEV, dtype=BF16, generator=gen) / k**0.5

    layers = [dict(qkv=weight((hq + 2 * hkv) * head_dim, hidden), o=weight(hidden, hq * head_dim),
                   gate_up=weight(2 * inter, hidden), down=weight(hidden, inter),
                   side=quantize_per_channel(weight(hidden, hidden)),
                   g1=torch.rand(hidden, device=DEV, dtype=BF16, generator=gen) + 0.5,
                   g2=torch.rand(hidden, device=DEV, dtype=BF16, generator=gen) + 0.5) for _ in range(3)]
    k_cache, v_cache, block_tables, _ = paged_setup(rows, 300, hkv, head_dim, seed=4)
    cos_sin = build_cos_sin_cache(head_dim, 4096, 1000000.0, None, device=DEV)
    positions = torch.full((rows,), 299, device=DEV)
    slots = block_tables[:, 299 // 16].long() * 16 + 299 % 16
    lens = torch.full((rows,), 300, device=DEV, dtype=torch.int32)
    x0 = torch.randn(rows, hidden, device=DEV, dtype=BF16, generator=gen)

    def chain():
        x, res = x0, torch.zeros_like(x0)
        for w in layers:
            h, res = fused_add_rms_norm(x, res, w["g1"], 1e-6)
            qkv = skinny_gemm(h, w["qkv"]).view(rows, hq + 2 * hkv, head_dim)
            q, k, v = qkv.split([hq, hkv, hkv], dim=1)
            rope_and_store_kv(q, k, v, positions, cos_sin, k_cache, v_cache, slots)
            attn = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5, num_splits=2)
            x = skinny_gemm(attn.reshape(rows, -1), w["o"])
            hq8, hs, res = rms_norm_fp8(x, w["g2"], 1e-6, res)
            side_q, side_s = quantize_rows_fp8(x)
            side = skinny_gemm(side_q, w["side"][0], x_scale=side_s, weight_scale=w["side"][1])
            h = (hq8.float() * hs).to(BF16)
            act = silu_and_mul(skinny_gemm(h, w["gate_up"]))
            x = skinny_gemm(act, w["down"]) + side
        return x + res

    monkeypatch.setattr(launch_settings, "PDL", False)
    expected = chain()  # (each layer writes the one slot it then reads: a rerun finds the caches as it needs)
    monkeypatch.setattr(launch_settings, "PDL", True)
    monkeypatch.setattr(launch_settings, "PDL_ELEMENTWISE", True)
    use_attention_prefetch(monkeypatch, 2)
    assert launch_settings.use_pdl(torch.device(DEV), elementwise=True) == (torch.cuda.get_device_capability()[0] >= 9)
    assert_graph_replays_give(chain, expected)
