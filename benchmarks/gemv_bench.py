"""Decode-step projections: our fused norm + GEMV (+ SiLU-and-mul) kernel vs the unfused path
(RMSNorm kernel, cuBLAS GEMM, SiLU kernel) at real model shapes, rows 1..8. Needs CUDA.

    python benchmarks/gemv_bench.py [--sweep] [--weights bf16 fp8] [--pdl both] [--out PATH]

Each variant is timed per call inside a CUDA graph (as the engine runs decode), rotating over
enough weight copies that L2 (60 MB) never serves repeats. Bandwidth = weight bytes / time, also
as a fraction of the device-to-device copy bandwidth. --sweep times other GEMV tile shapes. (The
engine runs 2 rows and more through kernels/skinny_gemm.py: benchmarks/skinny_gemm_bench.py.)
--weights fp8: FP8 weights with per-row scales (engine/models/fp8.py); the baseline is then the
W8A8 path (activations quantized per row, torch._scaled_mm). --pdl both: every variant with and
without programmatic dependent launch (consecutive calls in the graph overlap with it).
"""

from __future__ import annotations

import argparse
import importlib
import datetime as dt
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure import copy_bandwidth, graph_ms, run_info, write_json  # noqa: E402

# model -> (hidden, q size, kv size, intermediate, vocab, qkv bias)
SHAPES = {
    "qwen2.5-0.5b": (896, 896, 128, 4864, 151936, True),
    "llama-3.1-8b": (4096, 4096, 1024, 14336, 128256, False),
}
BF16 = torch.bfloat16


def projections(model: str) -> list[tuple[str, int, int, bool, bool, bool]]:
    """(name, weight rows N, K, fused norm (+residual), bias, silu_mul)."""
    hidden, q, kv, inter, vocab, bias = SHAPES[model]
    return [
        ("qkv", q + 2 * kv, hidden, True, bias, False),
        ("o", hidden, q, False, False, False),
        ("gate_up", 2 * inter, hidden, True, False, True),
        ("down", hidden, inter, False, False, False),
        ("lm_head", vocab, hidden, False, False, False),
    ]


def make_inputs(rows: int, n: int, k: int, norm: bool, bias: bool, copies: int, fp8: bool = False):
    """fp8: weights as (e4m3 weight, float32 row scales) pairs."""
    from graphserve.engine.models.fp8 import quantize_per_channel

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=BF16, generator=gen)
    res = torch.randn(rows, k, device="cuda", dtype=BF16, generator=gen) if norm else None
    g = torch.rand(k, device="cuda", dtype=BF16, generator=gen) + 0.5 if norm else None
    weights = [torch.randn(n, k, device="cuda", dtype=BF16, generator=gen) / k**0.5 for _ in range(copies)]
    weights = [quantize_per_channel(w) if fp8 else (w, None) for w in weights]
    biases = [torch.randn(n, device="cuda", dtype=BF16, generator=gen) for _ in range(copies)] if bias else None
    return x, res, g, weights, biases


def bench_projection(model: str, proj: tuple, rows: int, copy_gbs: float, tiles: list, fp8: bool = False,
                     pdl_settings: tuple[bool, ...] = (True,)) -> list[dict]:
    from graphserve.engine.models.fp8 import fp8_linear
    from graphserve.kernels import launch_settings
    from graphserve.kernels.activation import silu_and_mul
    from graphserve.kernels.gemv import gemv
    from graphserve.kernels.rmsnorm import fused_add_rms_norm

    name, n, k, norm, bias, silu = proj
    weight_bytes = n * k * (1 if fp8 else 2) + (n * 4 if fp8 else 0)
    copies = max(2, min(64, -(-256 * 2**20 // weight_bytes)))
    x, res, g, weights, biases = make_inputs(rows, n, k, norm, bias, copies, fp8)
    out_dtype = torch.float32 if name == "lm_head" else None

    def unfused(i):
        w, scale = weights[i]

        def fn():
            h = fused_add_rms_norm(x, res, g, 1e-6)[0] if norm else x
            b = biases[i] if biases else None
            y = fp8_linear(h, w, scale, b) if fp8 else F.linear(h, w, b)
            y = silu_and_mul(y) if silu else y
            return y.float() if out_dtype else y
        return fn

    def fused(i, tile):
        w, scale = weights[i]
        return lambda: gemv(x, w, biases[i] if biases else None, norm_weight=g, residual=res,
                              silu_mul=silu, out_dtype=out_dtype, weight_scale=scale, tile=tile)

    baseline = "unfused (W8A8 _scaled_mm)" if fp8 else "unfused (cuBLAS)"
    variants = [(baseline, None)] + [("gemv", t) for t in tiles]
    rows_out = []
    for pdl in pdl_settings:
        launch_settings.PDL = pdl
        for kind, tile in variants:
            fns = [unfused(i) if kind.startswith("unfused") else fused(i, tile) for i in range(copies)]
            try:
                ms = graph_ms(fns, min_calls=2 * copies)
            except Exception as e:  # a tile that does not compile or fit
                print(f"  {model} {name} rows={rows} {kind} {tile}: {type(e).__name__}: {str(e)[:100]}")
                continue
            rows_out.append(dict(model=model, projection=name, rows=rows, n=n, k=k, fused_norm=norm, bias=bias,
                                 silu_mul=silu, weights="fp8" if fp8 else "bf16", pdl=pdl, kind=kind,
                                 tile=list(tile) if tile else None, us=ms * 1e3, gb_per_s=weight_bytes / ms / 1e6,
                                 fraction_of_copy=weight_bytes / ms / 1e6 / copy_gbs))
    launch_settings.PDL = True
    del weights, biases
    torch.cuda.empty_cache()
    return rows_out


def sweep_tiles(fp8: bool = False):
    """Tiles whose accumulator takes at most 64 registers a thread; bf16 2048-wide K tiles for one or two rows."""
    from graphserve.kernels.gemv import GemvTile

    return [GemvTile(bn, bk, w) for bn in (1, 2, 4, 8, 16, 32, 64) for bk in (256, 512, 1024, 2048)
            for w in (4, 8) if bn * bk <= w * 32 * 64 and (fp8 or bk <= 1024 or bn <= 2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8],
                   help="rows of x (the GEMV gives each row its own programs)")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--weights", nargs="+", choices=["bf16", "fp8"], default=["bf16"])
    p.add_argument("--pdl", choices=["on", "off", "both"], default="on")
    p.add_argument("--projections", nargs="+", help="only these (qkv o gate_up down lm_head)")
    p.add_argument("--tiles", nargs="+", default=[],
                   help="also time these tiles: block_n,block_k,num_warps each")
    p.add_argument("--k-constexpr-max-k", nargs="+", type=int, default=None,
                   help="time the GEMV with each of these kernels.gemv.K_CONSTEXPR_MAX_K (K compiled in where K is at "
                        "most this; 0: never); default: the shipped one")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results" / f"gemv_bench-{dt.date.today()}.json")
    args = p.parse_args()

    gemv_module = importlib.import_module("graphserve.kernels.gemv")  # the package's `gemv` is the function

    copy = args.copy = copy_bandwidth(2048, 100)
    print(f"device-to-device copy: {copy['gb_per_s']:.0f} GB/s")
    results = []
    shipped = gemv_module.K_CONSTEXPR_MAX_K
    for max_k in args.k_constexpr_max_k or [shipped]:
        gemv_module.K_CONSTEXPR_MAX_K = max_k
        print(f"GEMV K_CONSTEXPR_MAX_K {max_k}")
        results += bench_all(args, k_constexpr_max_k=max_k)
    gemv_module.K_CONSTEXPR_MAX_K = shipped
    write_json(args.out, dict(**run_info("gemv_bench"), copy=copy, rows=results))
    return 0


def bench_all(args, k_constexpr_max_k: int) -> list[dict]:
    from graphserve.kernels.launch_settings import sm_count
    from graphserve.kernels.gemv import GemvTile, default_gemv_tile

    copy = args.copy
    pdl_settings = {"on": (True,), "off": (False,), "both": (True, False)}[args.pdl]
    results = []
    for model, weights in [(m, w) for m in args.models for w in args.weights]:
        fp8 = weights == "fp8"
        for proj in projections(model):
            name, n, k, _, _, silu = proj
            if (args.projections and name not in args.projections) or (fp8 and name == "lm_head"):
                continue  # the LM head stays in the model's dtype
            for rows in args.rows:
                default = default_gemv_tile(rows, n // 2 if silu else n, k, sm_count(torch.device("cuda")), silu,
                                            1 if fp8 else 2)
                tiles = [default] + [GemvTile(*map(int, spec.split(","))) for spec in args.tiles]
                if args.sweep:
                    tiles += [t for t in sweep_tiles(fp8) if t != default
                              and t.block_n * t.block_k * (2 if silu else 1) <= t.num_warps * 32 * 64]
                got = bench_projection(model, proj, rows, copy["gb_per_s"], tiles, fp8, pdl_settings)
                for r in got:
                    r["default"] = r["tile"] == list(default)
                    r["k_constexpr_max_k"] = k_constexpr_max_k
                results += got
                for pdl in pdl_settings:
                    mine_rows = [r for r in got if r["pdl"] == pdl]
                    base = next(r for r in mine_rows if r["kind"].startswith("unfused"))
                    mine = next(r for r in mine_rows if r["default"])
                    best = min((r for r in mine_rows if not r["kind"].startswith("unfused")), key=lambda r: r["us"])
                    print(f"{model:13s} {weights} {name:8s} M={rows} pdl={int(pdl)}  {base['kind'][9:-1]} "
                          f"{base['us']:7.2f} us ({base['fraction_of_copy']:5.1%})  gemv {mine['us']:7.2f} us "
                          f"({mine['fraction_of_copy']:5.1%}) {mine['kind']} {mine['tile']}  best {best['us']:7.2f} us "
                          f"{best['tile']}", flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
