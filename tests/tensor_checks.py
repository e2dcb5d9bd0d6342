"""Comparisons the kernel and model tests share."""

from __future__ import annotations

import json
import os

import pytest
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, computed in float32."""
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Tensors the kernel wrappers allocate (outputs, split-K partials) come back filled with NaN,
    or -7 for integers, so a value the kernel never wrote cannot pass for a right one."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(real_empty_like(*a, **kw)))


def report(row: dict) -> None:
    """A GPU test's measured values, appended to $GPU_REPORT (JSON lines) when it is set."""
    if os.environ.get("GPU_REPORT"):
        with open(os.environ["GPU_REPORT"], "a") as f:
            f.write(json.dumps(row) + "\n")
