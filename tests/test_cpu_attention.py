"""The CPU backend's decode attention: the C kernel (engine/cpu/attention.py) and the gather +
SDPA fallback both equal attention over each row's own context, for ragged lengths, GQA and a
strided q (a slice of the fused qkv tensor); the kernel in every build this machine executes
(tests/cpu_builds.py)."""

from __future__ import annotations

import pytest
import torch

from cpu_builds import builds, loaded
from cpu_references import attention_reference

from graphserve.engine.cpu import attention as cpu_attention
from graphserve.engine.models.attention import AttentionMetadata, TorchAttention

BLOCK = 16
# (KV heads, query heads, head_dim): SmolLM2-135M, Qwen2.5-0.5B, Llama-3.1-8B (the kernel's
# vector paths for head_dim 64 and 128), and a head_dim it takes the generic path for
SHAPES = [pytest.param(3, 9, 64, id="smollm2"), pytest.param(2, 14, 64, id="qwen2.5-0.5b"),
          pytest.param(8, 32, 128, id="llama-3.1-8b"), pytest.param(1, 3, 96, id="generic")]


@pytest.mark.parametrize("kv_heads,heads,dim", SHAPES)
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_decode_matches_per_row_attention(use_kernel, batch, kv_heads, heads, dim):
    if use_kernel and not cpu_attention.available():
        pytest.skip("no C compiler: the kernel is unavailable (the fallback is tested)")
    gen = torch.Generator().manual_seed(batch)
    num_blocks = 400
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    lens = torch.randint(1, 300, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = 1
    width = -(-int(lens.max()) // BLOCK) + 1  # a spare block, as a round's reservation leaves
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:batch * width] + 1).view(batch, width).int()
    q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen)[:, :heads]  # strided, like the qkv slice
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(batch, dtype=torch.int64),
                             block_tables=tables, context_lens=lens)
    out = TorchAttention(BLOCK, use_kernel=use_kernel).attend_decode(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, attention_reference(q, k_cache, v_cache, tables, lens, 0.125),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,heads,dim", SHAPES + [pytest.param(2, 4, 80, id="dim80"),
                                                      pytest.param(1, 2, 36, id="dim36")])
@pytest.mark.parametrize("library", builds(cpu_attention.LIBRARY))
def test_each_build_matches_per_row_attention(library, kv_heads, heads, dim):
    """Each instruction-set level's paths, for the head_dims they take (a multiple of 16, of 8, of
    4, any) and both task splits (few rows: one task per KV head; many: one per sequence)."""
    library = loaded(library)
    gen = torch.Generator().manual_seed(dim)
    k_cache = torch.randn(200, BLOCK, kv_heads, dim, generator=gen)
    v_cache = torch.randn(200, BLOCK, kv_heads, dim, generator=gen)
    for batch in (1, 9):
        lens = torch.randint(1, 150, (batch,), generator=gen, dtype=torch.int32)
        lens[0] = 1
        lens[-1] = 16 * 7 + 5  # whole blocks and a tail
        width = -(-int(lens.max()) // BLOCK)
        tables = (torch.randperm(199, generator=gen)[:batch * width] + 1).view(batch, width).int()
        q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen)[:, :heads]
        q[0, 0] *= 40  # a peaked softmax: exp's range, far from 0
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, library)
        torch.testing.assert_close(out, attention_reference(q, k_cache, v_cache, tables, lens, dim ** -0.5),
                                   rtol=1e-5, atol=1e-5)


def test_loading_the_kernel_keeps_denormals():
    """The kernel is compiled with -ffast-math but not linked with it: linking it pulls in
    crtfastmath.o, which sets flush-to-zero for the whole process, and the engine core then
    read a request's top_p of 5e-324 as 0.0 (and died on it)."""
    from graphserve.engine.cpu import attention as cpu_attention

    cpu_attention.available()  # loads the library when the machine can build it
    tiny = float("5e-324")
    assert tiny * 1.0 > 0
    assert torch.tensor([1e-40]).mul(1.0).item() > 0


@pytest.mark.parametrize("kv_heads,heads,dim", SHAPES)
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_a_sliding_window_reads_only_the_last_tokens(window, kv_heads, heads, dim):
    """With a window each row attends to its last `window` tokens (its own position and the window - 1
    before it, as transformers masks), in every build and in the SDPA fallback; what lies before the
    window is never read (NaN there would show)."""
    gen = torch.Generator().manual_seed(window)
    batch, num_blocks = 5, 60
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    lens = torch.tensor([1, window, window + 1, 16 * 3 + 7, 150], dtype=torch.int32)
    width = -(-int(lens.max()) // BLOCK)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:batch * width] + 1).view(batch, width).int()
    q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen)[:, :heads]
    expected = attention_reference(q, k_cache, v_cache, tables, lens, dim ** -0.5, window=window)
    for b, n in enumerate(lens.tolist()):  # poison every token before row b's window
        for t in range(max(0, n - window)):
            k_cache[tables[b, t // BLOCK], t % BLOCK] = float("nan")
            v_cache[tables[b, t // BLOCK], t % BLOCK] = float("nan")
    for library in builds(cpu_attention.LIBRARY):
        library = loaded(library.values[0])
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, library,
                                                   window=window)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(batch, dtype=torch.int64),
                             block_tables=tables, context_lens=lens)
    clean_k = torch.nan_to_num(k_cache)  # SDPA multiplies masked positions too: no NaN for it
    clean_v = torch.nan_to_num(v_cache)
    out = TorchAttention(BLOCK, use_kernel=False).attend_decode(q, clean_k, clean_v, meta, dim ** -0.5, window=window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads,heads,dim", SHAPES)
@pytest.mark.parametrize("window", [None, 5])
def test_attention_sinks_in_every_build(window, kv_heads, heads, dim):
    """gpt-oss's sinks: each query head's softmax has one more term, exp(sink), with no value; a sink far
    above the scores (its head's output near 0) and one far below (no effect) included. Every build, the
    decode and prefill fallbacks alike."""
    gen = torch.Generator().manual_seed(dim)
    batch, num_blocks = 4, 50
    k_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, kv_heads, dim, generator=gen)
    lens = torch.tensor([1, 6, 16 * 3 + 7, 150], dtype=torch.int32)
    width = -(-int(lens.max()) // BLOCK)
    tables = (torch.randperm(num_blocks - 1, generator=gen)[:batch * width] + 1).view(batch, width).int()
    q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen)[:, :heads]
    sinks = torch.randn(heads, generator=gen) * 2
    sinks[0], sinks[-1] = 60.0, -60.0
    expected = attention_reference(q, k_cache, v_cache, tables, lens, dim ** -0.5, window=window, sinks=sinks)
    assert expected[:, 0].abs().max() < 1e-6
    for library in builds(cpu_attention.LIBRARY):
        library = loaded(library.values[0])
        out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, library,
                                                   window=window, sinks=sinks)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    meta = AttentionMetadata(is_prefill=False, slot_mapping=torch.zeros(batch, dtype=torch.int64),
                             block_tables=tables, context_lens=lens)
    out = TorchAttention(BLOCK, use_kernel=False).attend_decode(q, k_cache, v_cache, meta, dim ** -0.5, window=window,
                                                                sinks=sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # a prefill of each row's last token after its cached context: the gather + masked path
    prefill = AttentionMetadata(is_prefill=True, slot_mapping=torch.zeros(batch, dtype=torch.int64),
                                block_tables=tables, context_lens=lens, cu_seqlens_q=torch.arange(batch + 1).int(),
                                query_lens_host=[1] * batch, context_lens_host=lens.tolist())
    out = TorchAttention(BLOCK, use_kernel=False)._prefill(q.contiguous(), k_cache, v_cache, prefill, dim ** -0.5,
                                                           window, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
