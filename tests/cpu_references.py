"""The references the CPU kernels' tests compare against, shared by the x86 builds' tests
(tests/test_cpu_attention.py, test_cpu_linear.py) and the ARM builds' (tests/test_cpu_arm.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                        lens: torch.Tensor, scale: float, window: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention row by row: torch's SDPA over each row's own context (its last `window`
    tokens), gathered from its blocks (caches [blocks, block_size, Hkv, D]); with sinks [Hq] (gpt-oss) a
    softmax over the scores and each head's sink logit, the sink's share dropped."""
    block = k_cache.shape[1]
    rows = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        lo = max(0, n - window) if window else 0
        blocks = tables[b, :-(-n // block)].long()
        k = k_cache[blocks].flatten(0, 1)[lo:n].transpose(0, 1)
        v = v_cache[blocks].flatten(0, 1)[lo:n].transpose(0, 1)
        if sinks is None:
            rows.append(F.scaled_dot_product_attention(q[b][:, None, :], k, v, scale=scale, enable_gqa=True)[:, 0])
            continue
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [Hq, n, D]
        scores = (q[b][:, None, :] @ k.transpose(1, 2))[:, 0] * scale
        probs = torch.softmax(torch.cat([scores, sinks[:, None]], dim=-1), dim=-1)[:, :-1]
        rows.append((probs[:, None, :] @ v)[:, 0])
    return torch.stack(rows)


def assert_matches_float64_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None) -> None:
    """out equals x @ weight.T + bias computed in float64, within float32 sums' rounding: k ulps of
    the largest partial sum."""
    reference = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == reference.shape and out.dtype == torch.float32
    bound = x.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T + 1)
    assert ((out.double() - reference).abs() <= bound).all()
