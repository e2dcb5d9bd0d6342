"""The CPU LoRA kernel (engine/cpu/lora.c) against a float64 reference at shapes that are not the vectors'
multiples, mixed ranks (0 on a slice, below the slots' rank dim), rows without an adapter and strided
per-layer views of the stacked slots, in every build this machine executes (tests/cpu_builds.py); a
row's numbers are its own alone and in any batch; slot contents rewritten in place are read at the next
call."""

from __future__ import annotations

import pytest
import torch

from cpu_builds import builds, loaded

from graphserve.engine.cpu import lora as cpu_lora

pytestmark = pytest.mark.skipif(not cpu_lora.available(), reason="no C compiler: the kernels are unavailable")


def _slots(num_slots: int, slice_sizes: tuple[int, ...], k: int, rank_dim: int, seed: int, layers: int = 3):
    """A [S, slices, R, k] and B [S, out, R]: layer 1's views of stacked [S, layers, ...] slots, as the
    engine's projections hold them; ranks int32 [S, slices] and scales [S]."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, layers, len(slice_sizes), rank_dim, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, layers, sum(slice_sizes), rank_dim, generator=gen) / rank_dim**0.5
    ranks = torch.randint(1, rank_dim + 1, (num_slots, len(slice_sizes)), generator=gen, dtype=torch.int32)
    ranks[0, 0] = 0  # slot 0 leaves its first slice alone
    ranks[-1, -1] = rank_dim
    scales = torch.rand(num_slots, generator=gen) * 4
    return a[:, 1], b[:, 1], ranks, scales


def _reference(y, x, a, b, ranks, scales, slice_sizes, slots) -> torch.Tensor:
    """y + each row's (B @ (A @ x)) * scale in float64."""
    out = y.double().clone()
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        start = 0
        for j, size in enumerate(slice_sizes):
            r = int(ranks[slot, j])
            u = a[slot, j, :r].double() @ x[row].double()
            out[row, start:start + size] += (b[slot, start:start + size, :r].double() @ u) * float(scales[slot])
            start += size
    return out


CASES = {"qkv": ((48, 16, 16), 72, 16), "one": ((130,), 200, 32), "gate_up": ((40, 40), 37, 16),
         "wide": ((576, 192, 192), 576, 16)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("library", builds(cpu_lora.LIBRARY))
def test_the_kernel_matches_a_float64_reference_and_each_row_is_its_own(case, library):
    library = loaded(library)
    slice_sizes, k, rank_dim = CASES[case]
    a, b, ranks, scales = _slots(4, slice_sizes, k, rank_dim, seed=len(case))
    proj = cpu_lora.projection(a, b, ranks, scales, slice_sizes, library)
    assert proj is not None
    gen = torch.Generator().manual_seed(7)
    rows, out = 11, sum(slice_sizes)
    x = torch.randn(rows, k + 3, generator=gen)[:, 2:2 + k]  # strided rows, not vector-aligned
    y = torch.randn(rows, out, generator=gen)
    slots = torch.tensor([2, -1, 0, 3, 1, 2, -1, 3, 0, 1, 2], dtype=torch.int32)
    got = cpu_lora.lora_add(y.clone(), x, proj, slots, library)
    torch.testing.assert_close(got.double(), _reference(y, x, a, b, ranks, scales, slice_sizes, slots),
                               rtol=2e-6, atol=2e-6)
    for row in (1, 6):  # no adapter: untouched
        assert torch.equal(got[row], y[row])
    assert torch.equal(got[2, :slice_sizes[0]], y[2, :slice_sizes[0]])  # slot 0 leaves its first slice alone
    assert not torch.equal(got[0], y[0])
    for row in range(rows):  # alone (its own aligned copy) as in the batch
        alone = cpu_lora.lora_add(y[row:row + 1].clone(), x[row:row + 1].clone(), proj, slots[row:row + 1], library)
        assert torch.equal(alone[0], got[row]), row
    order = torch.randperm(rows, generator=gen)  # and in another batch, at another place
    shuffled = cpu_lora.lora_add(y[order].clone(), x[order].contiguous(), proj, slots[order].contiguous(), library)
    assert torch.equal(shuffled, got[order])


@pytest.mark.parametrize("library", builds(cpu_lora.LIBRARY)[-2:])
def test_slot_contents_rewritten_in_place_are_read_at_the_next_call(library):
    library = loaded(library)
    slice_sizes, k = (24, 8, 8), 40
    a, b, ranks, scales = _slots(2, slice_sizes, k, 16, seed=3)
    proj = cpu_lora.projection(a, b, ranks, scales, slice_sizes, library)
    x, y = torch.randn(3, k), torch.randn(3, 40)
    slots = torch.tensor([1, 0, 1], dtype=torch.int32)
    cpu_lora.lora_add(y.clone(), x, proj, slots, library)
    new_a, new_b, new_ranks, _ = _slots(2, slice_sizes, k, 16, seed=4)
    a.copy_(new_a), b.copy_(new_b), ranks.copy_(new_ranks), scales.fill_(0.75)  # as engine/runner/lora_slots.py writes
    got = cpu_lora.lora_add(y.clone(), x, proj, slots, library)
    torch.testing.assert_close(got.double(), _reference(y, x, a, b, ranks, scales, slice_sizes, slots),
                               rtol=2e-6, atol=2e-6)


def test_it_refuses_what_it_cannot_take():
    a, b, ranks, scales = _slots(2, (8, 8), 16, 16, seed=5)
    assert cpu_lora.projection(a.double(), b.double(), ranks, scales, (8, 8)) is None
    assert cpu_lora.projection(a.bfloat16(), b.bfloat16(), ranks, scales, (8, 8)) is None
    assert cpu_lora.projection(a, b, ranks.long(), scales, (8, 8)) is None
    assert cpu_lora.projection(a, b, ranks, scales, (12, 4)) is not None  # any split of the output
    assert cpu_lora.projection(a, b, ranks, scales, (16,)) is None  # two slices of A, one of the output
    assert cpu_lora.projection(a.transpose(2, 3), b, ranks, scales, (8, 8)) is None
