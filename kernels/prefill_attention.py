"""Paged prefill attention: a packed variable-length batch of query tokens, causal.

All keys and values (cached prefix and the new tokens, which are already written) are read from
the paged cache, so the same kernel serves plain prefill, chunked prefill and prefix-cache hits.
Query token i of sequence b sits at absolute position context_lens[b] - q_len_b + i.

The launch grid is either (query tiles of the longest sequence, sequences, heads), or, with a
tile map, (tiles, heads): tile t is query block tiles[1, t] of sequence tiles[0, t], and a tile
whose sequence is -1 does nothing. A tile map has a fixed size however the tokens fall into
sequences, which is what a CUDA graph of padded prefills needs (engine/runner/prefill_graphs.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from graphserve.kernels.arg_checks import attention_output, check_kv_cache
from graphserve.kernels.launch_settings import dot_precision

_LOG2E = 1.4426950408889634


# The tile count and the block table's width change with every batch's lengths. Specialised (Triton
# compiles a variant per integer argument that is 1 or a multiple of 16), each first batch whose
# table was 16 or 32 blocks wide compiled the kernel while serving: every request of a multi-turn
# benchmark's fourth turn waited ~0.4 s for it (H200, the JIT probe (commit 636caa0, docs/benchmarks.md)).
@triton.jit(do_not_specialize=["num_tiles", "stride_bt"])
def _prefill_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_ptr, context_lens_ptr, out_ptr, sinks_ptr,
    tiles_ptr, num_tiles,
    scale_log2,
    stride_qt, stride_qh,
    stride_cb, stride_ct,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TILE_MAP: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    """WINDOW > 0: a sliding window, query at position p sees keys p - WINDOW < key <= p only. SINKS
    (gpt-oss): sinks_ptr[h] is head h's sink logit, one more term of each row's softmax denominator."""
    if TILE_MAP:
        tile = tl.program_id(0)
        b = tl.load(tiles_ptr + tile)
        pid_m = tl.load(tiles_ptr + num_tiles + tile)
        h = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
    if b < 0:
        return
    kvh = h // GROUP

    q_start = tl.load(cu_seqlens_ptr + b)
    q_len = tl.load(cu_seqlens_ptr + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len:  # a tile past a short sequence's queries (the plain grid)
        return
    ctx = tl.load(context_lens_ptr + b)
    first_pos = ctx - q_len  # absolute position of the sequence's first query token

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    pos = first_pos + offs_m
    tok = (q_start + offs_m).to(tl.int64)

    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None], other=0.0)

    # keys past the tile's last query position are never needed
    kv_end = tl.minimum(ctx, first_pos + tl.minimum(pid_m * BLOCK_M + BLOCK_M, q_len))
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * HEAD_DIM

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    if WINDOW > 0:  # the keys before the tile's first query's window are never needed (nor read)
        kv_lo = tl.maximum(first_pos + pid_m * BLOCK_M - WINDOW + 1, 0)
        kv_start = kv_lo // BLOCK_N * BLOCK_N
    else:
        kv_lo = 0
        kv_start = 0
    # without a window key 0 is visible to every row, so the first tile gives each row a finite max
    # (no NaN); with one, a row may see nothing in a tile: its max stays -inf and exp2 is taken from 0
    for n0 in range(kv_start, kv_end, BLOCK_N):
        key = n0 + offs_n
        n_mask = key < kv_end
        if WINDOW > 0:
            n_mask = n_mask & (key >= kv_lo)
        blk = tl.load(bt_row + key // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_cb + (key % BLOCK_SIZE) * stride_ct + head_off
        kv_off = row[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        visible = (key[None, :] <= pos[:, None]) & n_mask[None, :]
        if WINDOW > 0:
            visible = visible & (key[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if WINDOW > 0:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if SINKS:  # the sink's term, the sums and accumulators rescaled to the larger of the row's max and it
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    if WINDOW > 0:  # rows past the queries may have seen nothing (they are not stored)
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


class PrefillTile(NamedTuple):
    """Launch shape: query rows and KV tokens per tile, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_prefill_tile(head_dim: int, dtype: torch.dtype) -> PrefillTile:
    if dtype == torch.float32 and head_dim >= 128:
        return PrefillTile(64, 32, 4, 2)  # fp32 tiles are twice the bytes: keep shared memory small
    return PrefillTile(64, 64, 4, 2)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile: PrefillTile | None = None,
    tiles: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries q [T, Hq, D] over the paged cache (with a sliding `window`,
    each query over the last `window` positions up to its own; sinks [Hq]: each head's sink logit, one
    more term of its softmax's denominator).

    cu_seqlens_q [B+1] int32 (prefix sums of q lengths), context_lens [B] int32 (all KV tokens of
    the sequence after this step, >= its q length), max_seqlen_q a host int >= every q length.
    q may be a strided view (last dim contiguous). Returns [T, Hq, D] in q's dtype (or writes
    `out`). tile overrides the launch shape (benchmark sweeps). tiles: a tile map [2, N] int32
    (prefill_tile_map) for the tile launch shape's block_m; max_seqlen_q is then unused.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_tokens, num_heads, _ = q.shape
    out = attention_output(q, num_kv_heads, head_dim, out)
    batch = cu_seqlens_q.shape[0] - 1
    tile = tile or default_prefill_tile(head_dim, q.dtype)
    if tiles is not None:
        grid = (tiles.shape[1], num_heads)
    elif num_tokens == 0 or batch <= 0 or max_seqlen_q <= 0:
        return out
    else:
        grid = (triton.cdiv(max_seqlen_q, tile.block_m), batch, num_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out, out if sinks is None else sinks,
        tiles if tiles is not None else cu_seqlens_q, grid[0],
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        DOT_PREC=dot_precision(q.dtype),
        TILE_MAP=tiles is not None,
        WINDOW=window or 0,
        SINKS=sinks is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


def prefill_tile_map(query_lens: np.ndarray, block_m: int, num_tiles: int | None = None) -> np.ndarray:
    """[2, N] int32: (sequence, query block) of each tile covering `query_lens`; padded to
    `num_tiles` with sequence -1 (no work) when given."""
    per_seq = -(-query_lens.astype(np.int64) // block_m)
    seqs = np.repeat(np.arange(len(query_lens), dtype=np.int32), per_seq)
    blocks = np.arange(len(seqs), dtype=np.int32) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq).astype(np.int32)
    n = len(seqs) if num_tiles is None else num_tiles
    if len(seqs) > n:
        raise ValueError(f"{len(seqs)} query tiles do not fit in a map of {n}")
    tiles = np.full((2, n), -1, dtype=np.int32)
    tiles[0, :len(seqs)], tiles[1, :len(seqs)] = seqs, blocks
    return tiles


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference (fp32 math, result in q's dtype); loops over sequences on the host. sinks:
    each head's sink logit as one more column of its softmax, dropped after it."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    ctx_lens = context_lens.tolist()
    for b, ctx in enumerate(ctx_lens):
        start, end = cu[b], cu[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        n_blocks = -(-ctx // block_size)
        blocks = block_tables[b, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx].float()
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qs = q[start:end].float().transpose(0, 1)  # [Hq, q_len, D]
        scores = torch.matmul(qs, k.transpose(1, 2)) * scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        hidden = k_pos[None, None, :] > q_pos[None, :, None]
        if window:
            hidden |= k_pos[None, None, :] <= q_pos[None, :, None] - window
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out
