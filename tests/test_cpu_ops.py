"""The CPU backend's elementwise fusions (engine/cpu/ops.py) equal torch's ops to float32
rounding: RMSNorm with and without the residual add, strided rows; SiLU-and-mul over widths that
are not a multiple of the vector, and at the exp's extremes; in every build this machine executes
(tests/cpu_builds.py). The engine takes them on CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_builds import builds, loaded

from graphserve.engine.cpu import ops as cpu_ops
from graphserve.engine.models import layers

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler: the kernels are unavailable")


@pytest.mark.parametrize("rows,hidden", [(1, 576), (16, 576), (7, 100), (300, 896)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("library", builds(cpu_ops.LIBRARY))
def test_add_rms_norm_matches_torch(rows, hidden, with_residual, library):
    library = loaded(library)
    gen = torch.Generator().manual_seed(rows + hidden)
    wide = torch.randn(rows, hidden + 8, generator=gen) * 3
    x = wide[:, 4:4 + hidden]  # strided rows
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    out, new_residual = cpu_ops.add_rms_norm(x, residual, weight, 1e-6, library)
    h = x + residual if with_residual else x
    torch.testing.assert_close(new_residual, h, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(h, (hidden,), weight, 1e-6), rtol=2e-6, atol=2e-6)
    if not with_residual:
        assert new_residual is x


@pytest.mark.parametrize("rows,inter", [(1, 1536), (16, 1536), (3, 37), (5, 16), (200, 1536)])
@pytest.mark.parametrize("library", builds(cpu_ops.LIBRARY))
def test_silu_mul_matches_torch(rows, inter, library):
    library = loaded(library)
    gen = torch.Generator().manual_seed(rows * inter)
    y = torch.randn(rows, 2 * inter, generator=gen) * 6
    y[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's extremes: silu -> -0, x, 0, -0
    gate, up = y.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = cpu_ops.silu_mul(y, library)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(out).all()


def test_they_refuse_what_they_cannot_take():
    assert cpu_ops.silu_mul(torch.randn(2, 8, dtype=torch.float64)) is None
    assert cpu_ops.silu_mul(torch.randn(2, 7)) is None
    assert cpu_ops.add_rms_norm(torch.randn(2, 4, 8), None, torch.randn(8), 1e-6) is None  # not [T, H]
    assert cpu_ops.add_rms_norm(torch.randn(2, 8), None, torch.randn(4), 1e-6) is None  # weight size


def test_the_engine_takes_them_on_cpu(monkeypatch):
    calls = []
    for name in ("add_rms_norm", "silu_mul"):
        real = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.randn(64)
    layers.add_rms_norm(x, r, w, 1e-6)
    layers.rms_norm(x, w, 1e-6)
    layers.silu_and_mul(torch.randn(4, 128))
    assert calls == ["add_rms_norm", "add_rms_norm", "silu_mul"]
