"""Paged decode attention: one query token per sequence against its paged KV cache.

GQA: one program handles every query head of one KV head (the group is packed into the rows of
the tile), so each KV tile is read once per group. Split-K (flash-decoding): when there are too
few (sequence, KV head) pairs to fill the GPU, each sequence's KV range is cut into `num_splits`
parts computed in parallel; each writes a partial (max, sum, unnormalised acc), and either the
last split of each (sequence, KV head) to finish merges them (FUSED_MERGE) or a second kernel does.
All launch parameters depend on shapes only, so the wrapper is CUDA-graph capturable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from graphserve.kernels.arg_checks import attention_output, check_kv_cache
from graphserve.kernels.launch_settings import dot_precision, sm_count, use_pdl
from graphserve.kernels._pdl import wait_for_previous_kernel
from graphserve.kernels._prefetch import prefetch_l2
from graphserve.kernels._split_counters import last_to_arrive, split_counters
from graphserve.kernels.fp8_quant import AmaxedRows

_LOG2E = 1.4426950408889634
# Split-count heuristic, tuned on an H200 (benchmarks/kernel_bench.py --sweep): aim for about
# this many programs per SM, never fewer than this many KV tokens per split (with the longest
# context the block table can hold), never more splits than _MAX_SPLITS. The floor was 512 until
# decode_latency's A/B (--attention-min-split-tokens, contexts to 448): 128 gave 0.5B batch 1
# 1,726-1,688 -> 1,756-1,760 tok/s, batch 8 8,776 -> 9,024, and Llama-3.1-8B within noise
# (8615439:benchmarks/results/decode_latency-h200-*-split*-2026-12-01.json).
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 128
_MAX_SPLITS = 64
# With PDL, each program asks L2 for the K and V rows of its split's first PREFETCH_TILES tiles
# before it waits for the kernel before it (the qkv projection): those rows were written in earlier
# steps, and at short contexts the DRAM latency of the first tile is most of the kernel's time.
# Batches up to PREFETCH_MAX_BATCH only. H200, 2026-12-02 (decode_latency.py --attention-prefetch 2|0,
# interleaved): Qwen2.5-0.5B batch 1 1,798-1,801 vs 1,751-1,760 tok/s, batch 8 10,359 / 10,440 vs
# 10,268 / 10,256, but batch 64 58,797 / 59,034 vs 59,965 / 60,115; Llama-3.1-8B batch 1 246.7 vs
# 245.4, batch 8 1,790 vs 1,788.
PREFETCH_TILES = 2
PREFETCH_MAX_BATCH = 8
# The splits of one (sequence, KV head) count themselves done on a counter in global memory; the last
# one merges their partials, so no second kernel (and no second launch and grid-completion wait
# between attention and o_proj) is needed. Off: _decode_reduce_kernel merges. H200, 2026-12-02,
# interleaved (decode_latency.py --attention-fused-merge on|off): Qwen2.5-0.5B batch 64 63,651 /
# 63,205 vs 60,702 / 59,808 tok/s, batches 1 and 8 within noise (1,792-1,798 vs 1,792-1,800;
# 10,466 / 10,484 vs 10,468 / 10,417); Llama-3.1-8B batch 8 1,793 vs 1,766 (1,792 vs 1,766 in an
# earlier run), batches 1 and 64 within noise.
FUSED_MERGE = True
_MERGE_CHUNK = 8  # splits merged per load
# Measured slower and removed (the code is at 278118f): asked for its output quantized per row (an FP8 o_proj's
# W8A8 input), the program finishing a row's last KV head read the row back from L2 and quantized it, bit for
# bit the row-quantization kernel, one kernel fewer a layer. Llama-3.1-8B FP8, interleaved
# (8615439:benchmarks/results/decode_latency-h200-fp8-attention-row-quant-ab-2026-12-03.json): batch 64 16,802 / 16,867 against 16,880 /
# 16,954 tok/s, batch 8 2,683 / 2,686 against 2,694 / 2,693: one program quantizing a whole row lengthens the
# kernel's tail by about what the separate kernel took.
# Measured and removed (the code is at 99a6516): each split's first KV tile loaded into registers before the
# PDL wait but for the step's newest token, read after it (batches up to 8), and a floor of 2 or 4 tiles a
# split, one split writing the output without partials. H200, interleaved
# (8615439:benchmarks/results/decode_latency-h200-attention-preload-ab-2026-12-03.json): Qwen2.5-0.5B batch 1 within noise (1,807-1,832
# against 1,816-1,823 tok/s), batch 8 1.5% slower; floors of 2 and 4 tiles ~3.5% slower; Llama-3.1-8B batch 1
# within noise (FP8 +0.3%).


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, counter_ptr, amax_ptr, sinks_ptr,
    scale_log2,
    stride_qb, stride_qh,
    stride_cb, stride_ct,  # cache strides of a block and of a token (same for k and v)
    stride_bt,
    stride_ob, stride_oh,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH_TILES: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_GROUP: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    ROW_AMAX: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    """WINDOW > 0: a sliding window, each row reads only its last WINDOW tokens (the tiles before the
    window are not visited, the tokens before it in the first tile masked). SINKS (gpt-oss): sinks_ptr[h]
    is query head h's sink logit, one more term of its softmax's denominator (_fold_sink, where the row's
    splits are merged). PREFETCH_TILES: tiles of K and V rows to prefetch into L2 before the PDL wait (0: none).
    FUSED_MERGE (with WRITE_PARTIAL): the splits holding tokens count themselves finished on
    counter_ptr[pid] (kernels/_split_counters.py), and the last one merges their partials into out;
    empty splits return at once. ROW_AMAX (not WRITE_PARTIAL): amax_ptr[pid] is the largest |value| the
    program stored (its GROUP heads of row b), for the row quantization after it (fp8_quant.AmaxedRows)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // NUM_KV_HEADS
    kvh = pid % NUM_KV_HEADS
    offs_n = tl.arange(0, BLOCK_N)
    # the step's context lengths and block tables come from kernels at least two launches back:
    # complete (PDL), so they and the KV rows of earlier steps may be read before the wait
    ctx = tl.load(context_lens_ptr + b)
    num_tiles = tl.cdiv(ctx, BLOCK_N)
    if WINDOW > 0:  # the first token read, and the tile holding it
        lo = tl.maximum(ctx - WINDOW, 0)
        t_lo = lo // BLOCK_N
    else:
        lo = 0
        t_lo = 0
    tiles_per_split = tl.cdiv(num_tiles - t_lo, num_splits)
    t_start = t_lo + split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, num_tiles)
    if FUSED_MERGE and WRITE_PARTIAL:
        if t_start >= t_end:  # an empty split (past the context): the merge reads only the others
            return
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * HEAD_DIM
    for i in tl.static_range(PREFETCH_TILES):
        _prefetch_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, t_start + i, t_end, ctx, head_off, stride_cb, stride_ct,
                          HEAD_DIM, BLOCK_SIZE, BLOCK_N)
    if PDL:
        wait_for_previous_kernel()

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g

    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

    # Every tile in [t_start, t_end) holds at least one valid token, so no row of s is all -inf.
    for t in range(t_start, t_end):
        tok = t * BLOCK_N + offs_n
        n_mask = tok < ctx
        if WINDOW > 0:
            n_mask = n_mask & (tok >= lo)
        blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_cb + (tok % BLOCK_SIZE) * stride_ct + head_off
        kv_off = row[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if WRITE_PARTIAL:
        # partials are [B, Hq, num_splits] (m, l) and [B, Hq, num_splits, HEAD_DIM] (acc), fp32
        part = (b.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=g_mask)
        tl.store(part_l_ptr + part, l_i, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_mask[:, None])
        if FUSED_MERGE:
            active = tl.cdiv(num_tiles - t_lo, tiles_per_split)  # the splits holding tokens
            if last_to_arrive(counter_ptr + pid, active):
                _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr, b, kvh, active, num_splits,
                              stride_ob, stride_oh, NUM_KV_HEADS, GROUP, HEAD_DIM, MERGE_GROUP, MERGE_CHUNK, SINKS)
    else:
        if SINKS:
            alpha, l_i = _fold_sink(sinks_ptr, heads, g_mask, m_i, l_i)
            acc = acc * alpha[:, None]
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out, mask=g_mask[:, None])
        if ROW_AMAX:  # of the stored (rounded) values; the padded heads' rows are 0 / 0
            stored = tl.where(g_mask[:, None], tl.abs(out.to(tl.float32)), 0.0)
            tl.store(amax_ptr + pid, tl.max(tl.max(stored, 1), 0))


@triton.jit
def _fold_sink(sinks_ptr, heads, mask, m, l):
    """(alpha, l'): for rows whose exps were taken against max m (log2 units) and sum to l, each head's
    sink added to the sum, both rescaled to the larger of m and the sink (no overflow whichever is
    larger); the rows' accumulators are to be multiplied by alpha."""
    sink = tl.load(sinks_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m, sink)
    alpha = tl.exp2(m - m_new)
    return alpha, l * alpha + tl.exp2(sink - m_new)


@triton.jit
def _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr, b, kvh, active, num_splits, stride_ob,
                  stride_oh, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  MERGE_GROUP: tl.constexpr, MERGE_CHUNK: tl.constexpr, SINKS: tl.constexpr):
    """out for the GROUP query heads of (b, kvh) from the partials of its first `active` splits (the
    ones holding tokens; the rest are empty), in one pass with a running maximum. The partials were
    written by other programs: loaded through L2 (.cg), never a stale L1 line."""
    offs_g = tl.arange(0, MERGE_GROUP)
    offs_c = tl.arange(0, MERGE_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    base = (b.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits
    m_run = tl.full([MERGE_GROUP], float("-inf"), dtype=tl.float32)
    den = tl.zeros([MERGE_GROUP], dtype=tl.float32)
    num = tl.zeros([MERGE_GROUP, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, active, MERGE_CHUNK):
        offs_s = s0 + offs_c
        mask = g_mask[:, None] & (offs_s < active)[None, :]
        part = base[:, None] + offs_s[None, :]
        # every active split holds a token, so its m is finite; padded entries weigh exp2(-inf) = 0
        m = tl.load(part_m_ptr + part, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_l_ptr + part, mask=mask, other=0.0, cache_modifier=".cg")
        acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=mask[:, :, None],
                      other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 1))
        m_new = tl.where(g_mask, m_new, 0.0)  # padded heads: no -inf - -inf
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[:, None])
        den = den * alpha + tl.sum(l * w, 1)
        num = num * alpha[:, None] + tl.sum(acc * w[:, :, None], 1)
        m_run = m_new
    if SINKS:
        alpha, den = _fold_sink(sinks_ptr, heads, g_mask, m_run, den)
        num = num * alpha[:, None]
    out = num / tl.where(den > 0, den, 1.0)[:, None]
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@triton.jit
def _prefetch_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, t, t_end, ctx, head_off, stride_cb, stride_ct,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Ask L2 for the K and V rows of tile t (when t < t_end): every 128-byte line of each token's head
    row. Tokens past the range point into block 0, which the engine keeps allocated."""
    per_line: tl.constexpr = 1024 // k_cache_ptr.dtype.element_ty.primitive_bitwidth
    lines: tl.constexpr = (HEAD_DIM + per_line - 1) // per_line
    tok = t * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (tok < ctx) & (t < t_end)
    blk = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    row = tl.where(valid, blk * stride_cb + (tok % BLOCK_SIZE) * stride_ct + head_off, head_off)
    offs = row[:, None] + tl.minimum(tl.arange(0, lines) * per_line, HEAD_DIM - 1)[None, :]
    prefetch_l2(k_cache_ptr + offs)
    prefetch_l2(v_cache_ptr + offs)


@triton.jit
def _decode_reduce_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, sinks_ptr,
    stride_ob, stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
    SINKS: tl.constexpr,
):
    if PDL:
        wait_for_previous_kernel()
    pid = tl.program_id(0)
    b = pid // NUM_HEADS
    h = pid % NUM_HEADS
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    base = pid.to(tl.int64) * num_splits

    m_run = tl.full([CHUNK], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        offs_s = s0 + offs_c
        m = tl.load(part_m_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m_run = tl.maximum(m_run, m)
    m_max = tl.max(m_run, 0)

    num = tl.zeros([HEAD_DIM], dtype=tl.float32)
    den = tl.zeros([CHUNK], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        offs_s = s0 + offs_c
        s_mask = offs_s < num_splits
        m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
        l = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
        # empty splits (past the sequence's end) have l == 0 and m == -inf: weight 0, no NaN
        w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)
        acc = tl.load(part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_mask[:, None], other=0.0)
        num += tl.sum(acc * w[:, None], 0)
        den += l * w
    total = tl.sum(den, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_max, sink)
        alpha = tl.exp2(m_max - m_new)
        num = num * alpha
        total = total * alpha + tl.exp2(sink - m_new)
    out = num / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty))


class DecodeTile(NamedTuple):
    """Launch shape of the main kernel: KV tokens per inner-loop tile (spanning several pages
    when block_size is small), warps and software-pipeline stages."""

    block_n: int
    num_warps: int
    num_stages: int


def default_decode_tile(head_dim: int) -> DecodeTile:
    # H200 sweep: 64 x 128 (D=128) and 128 x 64 (D=64) tiles, 4 warps, were the fastest
    if head_dim >= 128:
        return DecodeTile(block_n=64, num_warps=4, num_stages=3)
    return DecodeTile(block_n=128, num_warps=4, num_stages=2)


def pick_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Split count from shapes only: about 4 programs per SM, each split >= 128 tokens, <= 64.
    The batch counts as the decode graph bucket that holds it (1, 2, 4, 8, then multiples of
    8: engine/cuda_graphs.batch_buckets), so an eager step over the graphs' table width splits
    each sequence's KV as the graph would, and sums it in the same order."""
    if batch <= 0 or num_kv_heads <= 0:
        return 1
    batch = 1 << (batch - 1).bit_length() if batch <= 8 else -(-batch // 8) * 8
    programs = batch * num_kv_heads
    want = _PROGRAMS_PER_SM * num_sms // programs
    cap = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tile: DecodeTile | None = None,
    row_amax: bool = False,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | AmaxedRows:
    """Attention of q [B, Hq, D] over each sequence's first context_lens[b] cached tokens (with a
    sliding `window`, over the last `window` of them only). sinks [Hq] (gpt-oss): each query head's sink
    logit, one more term of its softmax's denominator; a constant of the kernel whether there are any.

    block_tables [B, max_blocks] int32, context_lens [B] int32 (>= 1; padded rows use 1 and block 0);
    table entries past a sequence's last block are never read. q may be a strided view (last dim
    contiguous). Returns [B, Hq, D] in q's dtype, or writes `out` (same shape, last dim contiguous).
    num_splits=None picks the split count from (B, Hkv, max_blocks * block_size) and the SM count.
    tile overrides the launch shape (benchmark sweeps); None uses default_decode_tile.
    row_amax (when one split covers each row's context): AmaxedRows of out as [B, Hq * D] (out contiguous)
    with each KV head's group's largest |value| ([B, Hkv]), for the FP8 row quantization of o_proj's input.
    """
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    batch, num_heads, _ = q.shape
    out = attention_output(q, num_kv_heads, head_dim, out)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    tile = tile or default_decode_tile(head_dim)
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size
        if window:
            max_context = min(max_context, window + block_size)
        num_splits = pick_num_splits(batch, num_kv_heads, max_context, sm_count(q.device))
    num_splits = max(1, int(num_splits))

    counters = split_counters(q.device, "decode_attention", batch * num_kv_heads) \
        if num_splits > 1 and FUSED_MERGE else None
    if num_splits == 1:
        part_m = part_l = part_acc = out  # unused
    else:
        part_m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)

    row_amax = row_amax and num_splits == 1 and out.is_contiguous()
    amax = torch.empty((batch, num_kv_heads), dtype=torch.float32, device=q.device) if row_amax else part_m
    pdl = use_pdl(q.device)
    _decode_attention_kernel[(batch * num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_m, part_l, part_acc, out if counters is None else counters, amax,
        out if sinks is None else sinks,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        num_splits,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=tile.block_n,
        WRITE_PARTIAL=num_splits > 1,
        DOT_PREC=dot_precision(q.dtype),
        PDL=pdl,
        PREFETCH_TILES=PREFETCH_TILES if pdl and batch <= PREFETCH_MAX_BATCH else 0,
        FUSED_MERGE=counters is not None,
        MERGE_GROUP=triton.next_power_of_2(group),
        MERGE_CHUNK=_MERGE_CHUNK,
        ROW_AMAX=row_amax,
        WINDOW=window or 0,
        SINKS=sinks is not None,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        launch_pdl=pdl,
    )
    if num_splits > 1 and counters is None:
        _decode_reduce_kernel[(batch * num_heads,)](
            part_m, part_l, part_acc, out, out if sinks is None else sinks,
            out.stride(0), out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            CHUNK=min(16, triton.next_power_of_2(num_splits)),
            PDL=pdl,
            SINKS=sinks is not None,
            num_warps=4,
            launch_pdl=pdl,
        )
    return AmaxedRows(out.view(batch, num_heads * head_dim), amax) if row_amax else out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch reference (fp32 math, result in q's dtype): gather pages, mask, softmax (with each head's
    sink logit as one more column, dropped after it)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_tokens = block_tables.shape[1] * block_size
    bt = block_tables.long()
    # [B, max_blocks, block_size, Hkv, D] -> [B, Hkv, max_tokens, D]
    k = k_cache[bt].reshape(batch, max_tokens, num_kv_heads, head_dim).transpose(1, 2).float()
    v = v_cache[bt].reshape(batch, max_tokens, num_kv_heads, head_dim).transpose(1, 2).float()
    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhnd->bhgn", qg, k) * scale
    tokens = torch.arange(max_tokens, device=q.device)[None, :]
    valid = tokens < context_lens.long()[:, None]
    if window:
        valid &= tokens >= context_lens.long()[:, None] - window
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, num_kv_heads, group, 1).expand(batch, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
