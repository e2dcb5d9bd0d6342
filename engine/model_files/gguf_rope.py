"""The rope scaling a GGUF file states, which transformers' GGUF reader drops (its config keeps
plain rope, and a model served from it would drift from the original):

- ``{arch}.rope.scaling.type`` "linear" with ``{arch}.rope.scaling.factor``;
- Llama 3.1 / 3.2's llama3 scaling, which llama.cpp stores as the tensor ``rope_freqs.weight``:
  one divisor per frequency, computed from (factor, low_freq_factor, high_freq_factor,
  original_max_position_embeddings). Those four are recovered from the divisors, then checked:
  they must give back the file's frequencies.

    rope_parameters(metadata, architecture, rope_divisors) -> dict | None   # for transformers' rope_parameters

Any other scaling type (yarn, longrope, ...) is refused: the engine does not implement it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from graphserve.engine.errors import UnsupportedModelError

ROPE_FREQS_TENSOR = "rope_freqs.weight"


def rope_parameters(metadata: dict[str, Any], architecture: str,
                    rope_divisors: Sequence[float] | None) -> dict[str, Any] | None:
    """The scaling entries of transformers' ``rope_parameters`` (rope_theta aside) for this file,
    or None for plain rope. ``rope_divisors``: the values of its ``rope_freqs.weight`` tensor."""
    kind = metadata.get(f"{architecture}.rope.scaling.type")
    if rope_divisors is not None and kind in (None, "none"):
        return _llama3_parameters(metadata, architecture, [float(r) for r in rope_divisors])
    if kind in (None, "none"):
        return None
    if kind == "linear" and rope_divisors is None:
        return {"rope_type": "linear", "factor": float(metadata[f"{architecture}.rope.scaling.factor"])}
    raise UnsupportedModelError(f"rope scaling {kind!r} ({architecture}.rope.scaling.type"
                                f"{', with ' + ROPE_FREQS_TENSOR if rope_divisors is not None else ''}) is not "
                                "supported; graphserve implements linear and llama3 rope scaling")


def _llama3_parameters(metadata: dict[str, Any], architecture: str, divisors: list[float]) -> dict[str, Any] | None:
    """(factor, low/high_freq_factor, original_max_position_embeddings) that give these divisors.

    llama3 scaling divides frequency i by r_i = 1 / ((1 - s_i) / factor + s_i), where the
    smoothing s = (original / wavelength - low) / (high - low) is a line in 1 / wavelength,
    clipped to [0, 1]. So factor is the largest divisor, and the divisors strictly between 1
    and factor are points (1 / wavelength, s) of the line. Only the ratios of (original, low,
    high) matter, so low_freq_factor = 1, and the line gives the other two."""
    from graphserve.kernels.rotary import rope_inv_freq  # torch: only for files that have the tensor

    if all(abs(r - 1) < 1e-6 for r in divisors):
        return None
    theta = float(metadata.get(f"{architecture}.rope.freq_base", 10000.0))
    dim = _head_dim(metadata, architecture)
    inv_freq = rope_inv_freq(dim, theta).tolist()
    factor = max(divisors)
    points = [(f / (2 * math.pi), (1 / r - 1 / factor) / (1 - 1 / factor))
              for f, r in zip(inv_freq, divisors) if abs(r - 1) > 1e-6 and abs(r - factor) > 1e-6 * factor]
    if len(divisors) != len(inv_freq) or len(points) < 2:
        raise UnsupportedModelError(
            f"cannot read llama3 rope scaling from {ROPE_FREQS_TENSOR} ({len(divisors)} divisors for heads of {dim}, "
            f"{len(points)} of them between 1 and {factor:g}; 2 are needed)")
    slope, intercept = _least_squares_line(points)  # s = slope / wavelength + intercept
    if slope <= 0 or intercept >= 0:
        raise UnsupportedModelError(f"its {ROPE_FREQS_TENSOR} is not llama3 rope scaling, the only frequency table "
                                    "graphserve implements")
    high = 1 - 1 / intercept  # intercept = -low / (high - low), with low = 1
    original = slope * (high - 1)  # slope = original / (high - low)
    exact = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
             "original_max_position_embeddings": original}
    rounded = {**exact, "factor": round(factor, 4), "high_freq_factor": round(high, 4),
               "original_max_position_embeddings": round(original)}  # 8191.9999 -> 8192, when that stays exact
    for params in (rounded, exact):
        ours = rope_inv_freq(dim, theta, params).tolist()
        if all(abs(o * r / f - 1) < 1e-4 for o, r, f in zip(ours, divisors, inv_freq)):
            return params
    raise UnsupportedModelError(f"its {ROPE_FREQS_TENSOR} is not llama3 rope scaling, the only frequency table "
                                "graphserve implements")


def _head_dim(metadata: dict[str, Any], architecture: str) -> int:
    for key in ("attention.key_length", "rope.dimension_count"):
        if metadata.get(f"{architecture}.{key}"):
            return int(metadata[f"{architecture}.{key}"])
    return int(metadata[f"{architecture}.embedding_length"]) // int(metadata[f"{architecture}.attention.head_count"])


def _least_squares_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mean_x, mean_y = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return slope, mean_y - slope * mean_x
