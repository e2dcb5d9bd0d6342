"""The decode step's kernels one at a time at real shapes, for Nsight Compute (hardware counters).
Needs CUDA; run under ncu (benchmarks/gpu/latency.sh ncu):

    ncu --profile-from-start off ... python benchmarks/ncu_kernels.py [--targets NAME ...]

Each target runs once to compile and warm up, then once between cudaProfilerStart / Stop, so ncu
sees only the measured launches, in the order printed (to stderr, a target's kernels in a row).
Targets: the Llama-3.1-8B FP8 projections at one row (the GEMV; gate_up W8A8 with its quantization)
and at 64 rows (W8A8 skinny GEMM, its input's row quantization), the 8B bf16 o_proj GEMV (which
reaches the copy rate), Qwen2.5-0.5B's bf16 GEMVs at one row and its decode attention at batch 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gemv_bench import make_inputs, projections  # noqa: E402

BF16 = torch.bfloat16


def projection_targets(model: str, rows: int, fp8: bool) -> dict:
    """name -> a function launching that projection as the engine does at this many rows."""
    from graphserve.engine.models.fp8 import fp8_linear
    from graphserve.kernels.gemv import gemv

    out = {}
    for name, n, k, norm, bias, silu in projections(model):
        if name == "lm_head":
            continue
        x, res, g, weights, biases = make_inputs(rows, n, k, norm, bias, 1, fp8)
        w, scale = weights[0]
        b = biases[0] if biases else None
        tag = f"{model}-{'fp8' if fp8 else 'bf16'}-{name}-m{rows}"
        if rows == 1 and not (fp8 and silu):  # the engine's one-row path: the GEMV with the norm fused
            out[tag] = (lambda x=x, w=w, s=scale, b=b, r=res, g=g, silu=silu:
                        gemv(x, w, b, norm_weight=g, residual=r, silu_mul=silu, weight_scale=s))
        else:  # W8A8: the input's row quantization, then the skinny GEMM
            out[tag] = lambda x=x, w=w, s=scale, b=b, silu=silu: fp8_linear(x, w, s, b, silu_mul=silu)
    return out


def attention_target(batch: int, context: int, hq: int, hkv: int, head_dim: int) -> dict:
    from graphserve.kernels.decode_attention import paged_decode_attention

    block = 16
    blocks = -(-context // block)
    gen = torch.Generator(device="cuda").manual_seed(1)
    k_cache = torch.randn(batch * blocks, block, hkv, head_dim, device="cuda", dtype=BF16, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, hq, head_dim, device="cuda", dtype=BF16, generator=gen)
    tables = torch.arange(batch * blocks, device="cuda", dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    name = f"attention-b{batch}-ctx{context}-hq{hq}-hkv{hkv}-d{head_dim}"
    return {name: lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim**-0.5)}


def all_targets() -> dict:
    targets = {}
    targets.update(projection_targets("llama-3.1-8b", 1, fp8=True))
    targets.update(projection_targets("llama-3.1-8b", 64, fp8=True))
    targets.update({k: v for k, v in projection_targets("llama-3.1-8b", 1, fp8=False).items() if "-o-" in k})
    targets.update(projection_targets("qwen2.5-0.5b", 1, fp8=False))
    targets.update(attention_target(1, 256, 14, 2, 64))
    targets.update(attention_target(1, 256, 32, 8, 128))
    return targets


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", help="substrings: only the targets whose name holds one")
    args = p.parse_args()
    targets = {k: v for k, v in all_targets().items() if not args.targets or any(t in k for t in args.targets)}
    for fn in targets.values():  # compile and warm up, unprofiled
        fn()
    torch.cuda.synchronize()
    for name, fn in targets.items():
        print(name, file=sys.stderr, flush=True)
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
