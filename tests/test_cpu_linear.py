"""The CPU backend's decode-sized projection (engine/cpu/linear.py) equals x @ W.T + bias for
every row count it takes, ragged output widths, strided rows and no bias, in every build this
machine executes (tests/cpu_builds.py); the engine takes it for decode batches and keeps torch for
prefill-sized ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpu_builds import builds, loaded
from cpu_references import assert_matches_float64_product

from graphserve.engine.cpu import linear as cpu_linear
from graphserve.engine.models import layers

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C compiler: the kernel is unavailable")


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 70), (16, 1), (17, 33)])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 32])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("library", builds(cpu_linear.LIBRARY))
def test_panel_linear_matches_the_float64_product(n, k, rows, with_bias, library):
    library = loaded(library)
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    x = torch.randn(rows, k, generator=gen)
    out = cpu_linear.panel_linear(x, cpu_linear.pack_panels(weight, library), n, bias, library)
    assert_matches_float64_product(out, x, weight, bias)


def test_strided_rows_read_their_own_elements():
    """x may be a view whose rows are further apart than K (a slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(1)
    weight, wide = torch.randn(40, 24, generator=gen), torch.randn(5, 64, generator=gen)
    x = wide[:, 8:32]
    assert x.stride(0) == 64
    out = cpu_linear.panel_linear(x, cpu_linear.pack_panels(weight), 40)
    torch.testing.assert_close(out, x.contiguous() @ weight.T, rtol=1e-5, atol=1e-5)


def test_engine_linear_takes_the_kernel_for_decode_rows_only(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)
    packed = layers.pack_weight_for_cpu(weight)
    calls = []
    real = cpu_linear.panel_linear
    monkeypatch.setattr(cpu_linear, "panel_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for rows in (1, 8, cpu_linear.MAX_ROWS, cpu_linear.MAX_ROWS + 1, 200):
        x = torch.randn(rows, 32, generator=gen)
        torch.testing.assert_close(layers.linear(x, weight, bias, packed), F.linear(x, weight, bias),
                                   rtol=1e-5, atol=1e-5)
    assert calls == [1, 8, cpu_linear.MAX_ROWS]


def test_packing_refuses_what_the_kernel_cannot_take():
    assert cpu_linear.pack_panels(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_linear.pack_panels(torch.randn(8)) is None
    x = torch.randn(4, 8, dtype=torch.float64)
    assert not cpu_linear.applies(x, cpu_linear.pack_panels(torch.randn(8, 8)))
