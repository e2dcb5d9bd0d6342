"""kernels/lora.py's shrink and expand against their torch reference: per row (decode: padded and base
rows, strided per-layer views of the stacked slots, mixed ranks, slices an adapter leaves alone) and per
segment (prefill tile maps, padded for a fixed grid) under TRITON_INTERPRET=1 on CPU; the CPU path of
engine/lora/apply.py against the same reference; on a GPU (marked gpu) the kernels at Llama-3.1-8B's
shapes, rank 16 on all seven projections, and a tiny model's greedy tokens through the CUDA graphs equal
transformers + peft's."""

from __future__ import annotations

import pytest
import torch

from graphserve.engine.lora.apply import LoraWeights, SlotTable, add_lora
from graphserve.engine.lora.rows import LoraRows
from graphserve.kernels.lora import SEGMENT_ROWS, block_rank, lora_add, lora_add_ref, segment_tiles


def _slots(num_slots: int, num_slices: int, k: int, n: int, max_rank: int, device: str = "cpu",
           dtype: torch.dtype = torch.float32, layers: int = 2, seed: int = 0):
    """Stacked A [S, L, slices, R, K] and B [S, L, N, R] as the engine holds them; layer 1's views."""
    gen = torch.Generator().manual_seed(seed)
    rank_dim = block_rank(max_rank)
    a = (torch.randn(num_slots, layers, num_slices, rank_dim, k, generator=gen) / k**0.5).to(device, dtype)
    b = (torch.randn(num_slots, layers, n, rank_dim, generator=gen) / rank_dim**0.5).to(device, dtype)
    return a[:, 1], b[:, 1]


def _ranks(rows: list[list[int]], device: str = "cpu") -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=device)


@pytest.mark.parametrize("slice_sizes", [(48, 16, 16), (130,), (40, 40)], ids=["qkv", "one", "gate_up"])
def test_rows_match_the_reference(slice_sizes):
    ns, k = len(slice_sizes), 72
    a, b = _slots(3, ns, k, sum(slice_sizes), max_rank=8)
    ranks = _ranks([[8] * ns, [3] + [0] * (ns - 1), [0] * ns])  # slot 1 leaves all but its first slice alone
    scales = torch.tensor([0.5, 2.0, 1.0])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, k, generator=gen)
    y = torch.randn(6, sum(slice_sizes), generator=gen)
    slots = torch.tensor([0, -1, 1, 2, 0, 1], dtype=torch.int32)
    want = lora_add_ref(y.clone(), x, a, b, ranks, scales, slice_sizes, slots=slots)
    got = lora_add(y.clone(), x, a, b, ranks, scales, slice_sizes, slots=slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[1], y[1]) and torch.equal(got[3], y[3])  # no adapter / an empty slot: untouched
    assert not torch.allclose(got[0], y[0])


@pytest.mark.parametrize("segments", [False, True], ids=["rows", "segments"])
def test_a_fused_norm_and_silu_match_the_reference(segments):
    """A projection whose kernel fused the RMSNorm before it (the adapter norms x itself) and SiLU-and-mul
    after it (gate_up: the expand writes silu(gate) * up; rows without an adapter get it too)."""
    slice_sizes, k = (40, 40), 48
    a, b = _slots(2, 2, k, 80, max_rank=8)
    ranks = _ranks([[8, 8], [4, 0]])
    scales = torch.tensor([1.0, 3.0])
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(5, k, generator=gen), torch.randn(5, 80, generator=gen)
    norm = (torch.rand(k, generator=gen) + 0.5, 1e-5)
    slots = torch.tensor([1, -1, 0, 0, -1], dtype=torch.int32)
    where = dict(tiles=torch.from_numpy(segment_tiles([(1, 0, 1), (0, 2, 4)]))) if segments else dict(slots=slots)
    want = lora_add_ref(y.clone(), x, a, b, ranks, scales, slice_sizes, norm=norm, silu_mul=True, **where)
    got = lora_add(y.clone(), x, a, b, ranks, scales, slice_sizes, norm=norm, silu_mul=True, **where)
    assert got.shape == (5, 40)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    plain = torch.nn.functional.silu(y[1, :40]) * y[1, 40:]
    torch.testing.assert_close(got[1], plain, rtol=1e-5, atol=1e-5)


def test_segments_match_the_reference():
    slice_sizes, k = (32, 16, 16), 80
    a, b = _slots(2, 3, k, 64, max_rank=16)
    ranks = _ranks([[16, 16, 0], [5, 5, 5]])
    scales = torch.tensor([1.5, 0.25])
    segments = [(0, 0, SEGMENT_ROWS + 7), (-1, SEGMENT_ROWS + 7, SEGMENT_ROWS + 9), (1, SEGMENT_ROWS + 9, 45)]
    tiles = torch.from_numpy(segment_tiles(segments, min_tiles=6))
    assert tiles.shape == (6, 3) and tiles[3:, 2].tolist() == [-1, -1, -1]  # padding for a fixed grid
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(45, k, generator=gen)
    y = torch.randn(45, 64, generator=gen)
    want = lora_add_ref(y.clone(), x, a, b, ranks, scales, slice_sizes, tiles=tiles)
    got = lora_add(y.clone(), x, a, b, ranks, scales, slice_sizes, tiles=tiles)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[SEGMENT_ROWS + 7:SEGMENT_ROWS + 9], y[SEGMENT_ROWS + 7:SEGMENT_ROWS + 9])


def test_the_cpu_path_matches_the_reference():
    slice_sizes, k = (24, 8, 8), 32
    a, b = _slots(3, 3, k, 40, max_rank=8)
    ranks = _ranks([[8, 0, 8], [2, 2, 2], [0, 0, 0]])
    table = SlotTable({"qkv": ranks}, torch.tensor([0.5, 3.0, 1.0]), {"qkv": ranks.tolist()}, [0.5, 3.0, 1.0])
    weights = LoraWeights("qkv", a, b, slice_sizes, table)
    x, y = torch.randn(5, k), torch.randn(5, 40)
    slots = torch.tensor([1, 1, -1, 0, 2], dtype=torch.int32)
    want = lora_add_ref(y.clone(), x, a, b, ranks, table.scales, slice_sizes, slots=slots)
    got = add_lora(y.clone(), x, weights, LoraRows.for_rows(slots))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for i in range(5):  # each row's numbers are its own, whatever shares its call (rows 0 and 1 share slot 1)
        assert torch.equal(add_lora(y[i:i + 1].clone(), x[i:i + 1], weights, LoraRows.for_rows(slots[i:i + 1])), got[i:i + 1])
    assert not LoraRows.for_rows(torch.tensor([-1, -1], dtype=torch.int32)).applies


def test_bad_shapes_are_refused():
    a, b = _slots(2, 3, 16, 32, max_rank=4)
    ranks = _ranks([[4, 4, 4]] * 2)
    x, y = torch.randn(2, 16), torch.zeros(2, 32)
    with pytest.raises(ValueError, match="slices"):
        lora_add(y, x, a, b, ranks, torch.ones(2), (16, 8), slots=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="not both"):
        lora_add(y, x, a, b, ranks, torch.ones(2), (16, 8, 8))


# ---- on a GPU ----------------------------------------------------------------------------------------

# Llama-3.1-8B's projections: (input, output slices)
SHAPES_8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
             "down": (14336, (4096,))}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(SHAPES_8B))
@pytest.mark.parametrize("rows, distinct", [(1, 1), (64, 8), (64, 64)])
def test_kernels_at_8b_shapes_rank_16(kind, rows, distinct):
    k, slice_sizes = SHAPES_8B[kind]
    num_slots = max(distinct, 8)
    a, b = _slots(num_slots, len(slice_sizes), k, sum(slice_sizes), 16, "cuda", torch.bfloat16)
    ranks = _ranks([[16] * len(slice_sizes)] * num_slots, "cuda")
    scales = torch.full((num_slots,), 2.0, device="cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(rows, sum(slice_sizes), device="cuda", dtype=torch.bfloat16)
    slots = (torch.arange(rows, device="cuda") % distinct).to(torch.int32)
    want = lora_add_ref(y.clone(), x, a, b, ranks, scales, slice_sizes, slots=slots.cpu())
    got = lora_add(y.clone(), x, a, b, ranks, scales, slice_sizes, slots=slots)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    if kind in ("qkv", "gate_up"):  # after a norm the projection's kernel fused (and gate_up's SiLU)
        fused = dict(norm=(torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5), silu_mul=kind == "gate_up")
        want = lora_add_ref(y.clone(), x, a, b, ranks, scales, slice_sizes, slots=slots.cpu(), **fused)
        got = lora_add(y.clone(), x, a, b, ranks, scales, slice_sizes, slots=slots, **fused)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2)
    lens = [rows, 300, 7][:3 if rows > 1 else 1]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    segments = [(i % distinct, s, s + n) for i, (s, n) in enumerate(zip(starts, lens))]
    tiles = torch.from_numpy(segment_tiles(segments)).cuda()
    x = torch.randn(sum(lens), k, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(sum(lens), sum(slice_sizes), device="cuda", dtype=torch.bfloat16)
    want = lora_add_ref(y.clone(), x, a, b, ranks, scales, slice_sizes, tiles=tiles)
    got = lora_add(y.clone(), x, a, b, ranks, scales, slice_sizes, tiles=tiles)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_greedy_through_the_cuda_graphs_matches_peft(tmp_path):
    pytest.importorskip("peft", reason="peft (a dev extra) makes the adapters and the reference")
    from graphserve import LLM, LoraRequest, SamplingParams
    from graphserve.engine.tokenizer import Tokenizer
    from lora_adapters import ADAPTER_SPECS, make_adapter, peft_greedy
    from tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", "llama")
    loras = {name: LoraRequest(name, i + 1, str(make_adapter(model, tmp_path / name, seed=i, **spec)))
             for i, (name, spec) in enumerate(ADAPTER_SPECS.items())}
    ids = Tokenizer(model).encode("The quick brown fox jumps over a lazy dog.")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = {n: peft_greedy(model, loras[n].path if n else None, ids, 16) for n in (None, *loras)}
    llm = LLM(str(model), device="cuda", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
              max_num_seqs=8, num_kv_blocks=128)
    names = [None, *loras, "all", None]
    for _ in range(2):  # the second pass hits the prefix cache, under each adapter's own keys
        outs = llm.generate([ids] * len(names), params, lora_request=[loras.get(n) for n in names])
        assert [o.token_ids for o in outs] == [want[n] for n in names]
    stats = llm.engine.stats()
    assert stats.graph_replays and "cpu" not in stats.eager_rounds
