"""Projections at decode batch sizes on a GPU: kernels/skinny_gemm.py against cuBLAS, for bf16
weights (F.linear) and W8A8 FP8 (torch._scaled_mm), each timed inside a CUDA graph over enough
weight copies that L2 holds none of them. Every FP8 variant includes the per-row activation
quantization (kernels/fp8_quant.py), as in the decoder. --sweep also times a grid of skinny_gemm
tiles at the --sweep-rows.

    python benchmarks/skinny_gemm_bench.py --models llama-3.1-8b --rows 2 8 16 64 128 --weights fp8 bf16 --sweep --out skinny.json
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gemv_bench import projections  # noqa: E402
from measure import copy_bandwidth, graph_ms, run_info, write_json  # noqa: E402

BF16 = torch.bfloat16


def sweep_tiles(rows: int, weight_bytes: int, deep: bool = False, tma: bool = False) -> list:
    """The sweep's tiles; deep: pipelines 4 to 12 stages deep and 8 warps too, where the stages fit
    the kernel's shared-memory budget (more weight bytes in flight a program); tma:
    2, 4 or 8 stages of 128- or 256-byte K tiles, K split up to 4 (several programs an SM where the stages fit)."""
    from graphserve.kernels.skinny_gemm import SHARED_MEMORY_BUDGET, SkinnyGemmTile, stage_bytes

    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    if tma:
        tiles = [SkinnyGemmTile(bn, tile_bytes // weight_bytes, block_m, split, 4, stages)
                 for bn, tile_bytes, split, stages in itertools.product((64, 128), (128, 256), (1, 2, 3, 4),
                                                                        (2, 4, 8))]
        return [t for t in tiles if t.num_stages * stage_bytes(t, weight_bytes) <= SHARED_MEMORY_BUDGET]
    if not deep:
        return [SkinnyGemmTile(bn, tile_bytes // weight_bytes, block_m, split, 4, stages)
                for bn, tile_bytes, split, stages in itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (3, 5))]
    tiles = [SkinnyGemmTile(bn, tile_bytes // weight_bytes, block_m, split, warps, stages)
             for bn, tile_bytes, split, warps, stages in itertools.product((64, 128), (128, 256), (1, 2, 4), (4, 8),
                                                                          (4, 6, 8, 12))]
    return [t for t in tiles if t.num_stages * stage_bytes(t, weight_bytes) <= SHARED_MEMORY_BUDGET]


def bench(model: str, proj: tuple, rows: int, copy_gbs: float, weights: str, tiles: list) -> list[dict]:
    from graphserve.engine.models.fp8 import quantize_per_channel
    from graphserve.kernels.fp8_quant import quantize_rows_fp8
    from graphserve.kernels.skinny_gemm import default_skinny_gemm_tile, skinny_gemm

    name, n, k, _, bias, _ = proj
    fp8_bytes = n * k + 4 * n
    copies = max(2, min(64, -(-256 * 2**20 // fp8_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=BF16, generator=gen)
    bf16 = [torch.randn(n, k, device="cuda", dtype=BF16, generator=gen) / k**0.5 for _ in range(copies)]
    fp8 = [quantize_per_channel(w) for w in bf16] if weights == "fp8" else None
    b = torch.randn(n, device="cuda", dtype=BF16, generator=gen) if bias else None

    def scaled_mm(i):
        def fn():
            xq, xs = quantize_rows_fp8(x)
            return torch._scaled_mm(xq, fp8[i][0].t(), scale_a=xs, scale_b=fp8[i][1][None, :], bias=b, out_dtype=BF16)
        return fn

    def triton_gemm(i, tile, weight_only=False):
        def fn():
            if fp8 is None:
                return skinny_gemm(x, bf16[i], b, tile=tile)
            if weight_only:
                return skinny_gemm(x, fp8[i][0], b, weight_scale=fp8[i][1], tile=tile)
            xq, xs = quantize_rows_fp8(x)
            return skinny_gemm(xq, fp8[i][0], b, x_scale=xs, weight_scale=fp8[i][1], out_dtype=BF16, tile=tile)
        return fn

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if fp8 is None:
        variants = [("bf16 cuBLAS", None, lambda i: (lambda: F.linear(x, bf16[i], b)), 2 * n * k),
                    ("bf16 skinny_gemm", default_skinny_gemm_tile(rows, n, k, sms, 2), None, 2 * n * k)]
        variants += [("bf16 skinny_gemm sweep", t, None, 2 * n * k) for t in tiles]
    else:
        variants = [("W8A8 _scaled_mm", None, scaled_mm, fp8_bytes),
                    ("W8A8 skinny_gemm", default_skinny_gemm_tile(rows, n, k, sms), None, fp8_bytes),
                    ("FP8 weight-only skinny_gemm", default_skinny_gemm_tile(rows, n, k, sms, x_bytes=2),
                     lambda i: triton_gemm(i, default_skinny_gemm_tile(rows, n, k, sms, x_bytes=2), True), fp8_bytes)]
        variants += [("W8A8 skinny_gemm sweep", t, None, fp8_bytes) for t in tiles]
    out = []
    for kind, tile, make, weight_bytes in variants:
        fns = [make(i) if make else triton_gemm(i, tile) for i in range(copies)]
        try:
            ms = graph_ms(fns, min_calls=2 * copies)
        except Exception as e:  # a tile that does not compile or fit
            print(f"  {model} {name} rows={rows} {kind} {tile}: {type(e).__name__}: {str(e)[:100]}")
            continue
        row = dict(model=model, projection=name, rows=rows, n=n, k=k, weights=weights, kind=kind, tile=list(tile) if tile else None,
                   us=ms * 1e3, gb_per_s=weight_bytes / ms / 1e6, fraction_of_copy=weight_bytes / ms / 1e6 / copy_gbs)
        out.append(row)
        if "sweep" not in kind:
            print(f"{model:13s} {name:8s} rows={rows:4d} {kind:28s} {str(row['tile'] or ''):28s} "
                  f"{row['us']:8.1f} us {row['gb_per_s']:7.0f} GB/s", flush=True)
    sweep = [r for r in out if "sweep" in r["kind"]]
    if sweep:
        best = min(sweep, key=lambda r: r["us"])
        print(f"{model:13s} {name:8s} rows={rows:4d} {'best of sweep':20s} {str(best['tile']):28s} "
              f"{best['us']:8.1f} us {best['gb_per_s']:7.0f} GB/s", flush=True)
    del bf16, fp8
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b"])
    parser.add_argument("--rows", nargs="+", type=int, default=[2, 8, 16, 64, 128])
    parser.add_argument("--projections", nargs="+", default=["qkv", "o", "gate_up", "down"])
    parser.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16", "fp8"])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles at --sweep-rows")
    parser.add_argument("--sweep-rows", nargs="+", type=int, default=[8, 64])
    parser.add_argument("--deep", action="store_true", help="sweep deeper pipelines and 8 warps instead")
    parser.add_argument("--w8a8-tma", choices=["on", "off"], default=None,
                        help="W8A8 K tiles loaded by the copy engine at every row count (on) or never (off), "
                             "overriding kernels.skinny_gemm.W8A8_TMA_MIN_ROWS; with --sweep and on, a grid of "
                             "shallower pipelines and splits up to 4 for it")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.w8a8_tma:
        skinny = importlib.import_module("graphserve.kernels.skinny_gemm")
        skinny.W8A8_TMA_MIN_ROWS = skinny.W8A8_TMA_SILU_MIN_ROWS = 1 if args.w8a8_tma == "on" else 0
    copy = copy_bandwidth()
    rows = []
    for model in args.models:
        for proj in projections(model):
            if proj[0] not in args.projections:
                continue
            for weights in args.weights:
                for m in args.rows:
                    tiles = (sweep_tiles(m, 1 if weights == "fp8" else 2, args.deep, args.w8a8_tma == "on")
                             if args.sweep and m in args.sweep_rows else [])
                    rows += bench(model, proj, m, copy["gb_per_s"], weights, tiles)
                    # after each shape, so a sweep cut short by its time limit still leaves what it measured
                    write_json(args.out, dict(**run_info("skinny_gemm_bench"), copy=copy, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
