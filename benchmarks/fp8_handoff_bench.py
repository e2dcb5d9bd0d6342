"""Where engine/models/layers.FP8_HANDOFF's time goes, per kernel, on a GPU (Llama-3.1-8B shapes): the
o and down projections with one x scale a row against a scale for each group of K (a head, or each
64 of gate_up's outputs), at their default tiles and with the tiles swapped; gate_up with and without
quantizing its output; decode attention with and without; the row quantization the handoff replaces.
Each timed inside a CUDA graph over enough weight copies that L2 holds none of them.

    python benchmarks/fp8_handoff_bench.py --rows 8 64 --out handoff.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure import graph_ms, run_info, write_json  # noqa: E402

FP8 = torch.float8_e4m3fn
COPIES = 8  # weight copies a graph cycles through (8 x 58 MB of down_proj: past L2)


def fp8_weights(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [((torch.randn(n, k, device="cuda") * 40).clamp(-448, 448).to(FP8),
             torch.rand(n, device="cuda") * 1e-3 + 1e-5) for _ in range(COPIES)]


def projection_rows(rows: int) -> list[dict]:
    from kernels.skinny_gemm import default_skinny_gemm_tile, skinny_gemm
    from kernels._common import sm_count

    sms = sm_count(torch.device("cuda"))
    out = []
    for name, n, k, group in (("o", 4096, 4096, 128), ("down", 4096, 14336, 64)):
        weights = fp8_weights(n, k)
        xq = (torch.randn(rows, k, device="cuda") * 40).clamp(-448, 448).to(FP8)
        per_row = torch.rand(rows, 1, device="cuda") * 1e-2
        grouped = torch.rand(rows, k // group, device="cuda") * 1e-2
        row_tile = default_skinny_gemm_tile(rows, n, k, sms)
        group_tile = default_skinny_gemm_tile(rows, n, k, sms, x_group=group)
        for label, scale, tile in (("row scales, row tile", per_row, row_tile),
                                   ("row scales, group tile", per_row, group_tile),
                                   ("group scales, group tile", grouped, group_tile)):
            ms = graph_ms([lambda w=w, s=s, scale=scale, tile=tile: skinny_gemm(xq, w, x_scale=scale, weight_scale=s,
                                                                                tile=tile) for w, s in weights],
                          min_calls=2 * COPIES)
            out.append(dict(kernel=name, rows=rows, variant=label, tile=list(tile), us=ms * 1e3))
            print(f"{name:8s} {rows:3d} {label:26s} {tuple(tile)} {ms * 1e3:8.2f} us", flush=True)
    return out


def gate_up_rows(rows: int) -> list[dict]:
    from kernels.skinny_gemm import skinny_gemm

    weights = fp8_weights(28672, 4096)
    xq = (torch.randn(rows, 4096, device="cuda") * 40).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(rows, 1, device="cuda") * 1e-2
    out = []
    for quantize in (False, True):
        ms = graph_ms([lambda w=w, s=s: skinny_gemm(xq, w, x_scale=x_scale, weight_scale=s, silu_mul=True,
                                                    quantize_out=quantize) for w, s in weights], min_calls=2 * COPIES)
        out.append(dict(kernel="gate_up", rows=rows, variant=f"quantize_out={quantize}", us=ms * 1e3))
        print(f"gate_up  {rows:3d} quantize_out={quantize!s:5s} {ms * 1e3:8.2f} us", flush=True)
    return out


def attention_rows(rows: int, context: int = 256) -> list[dict]:
    from kernels.decode_attention import paged_decode_attention

    block, hkv, hq, d = 16, 8, 32, 128
    blocks = rows * context // block
    k_cache = torch.randn(blocks + 1, block, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(blocks, device="cuda") + 1).view(rows, context // block).to(torch.int32)
    lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    out = []
    for quantize in (False, True):
        ms = graph_ms([lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5,
                                                      quantize_out=quantize)], min_calls=20)
        out.append(dict(kernel="attention", rows=rows, context=context, variant=f"quantize_out={quantize}",
                        us=ms * 1e3))
        print(f"attention {rows:3d} ctx {context} quantize_out={quantize!s:5s} {ms * 1e3:8.2f} us", flush=True)
    return out


def quantize_rows(rows: int) -> list[dict]:
    from kernels.fp8_quant import quantize_rows_fp8

    out = []
    for k in (4096, 14336):
        xs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        ms = graph_ms([lambda x=x: quantize_rows_fp8(x) for x in xs], min_calls=2 * COPIES)
        out.append(dict(kernel="quantize_rows_fp8", rows=rows, k=k, us=ms * 1e3))
        print(f"quantize {rows:3d} K {k:5d} {ms * 1e3:8.2f} us", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for m in args.rows:
        rows += projection_rows(m) + gate_up_rows(m) + attention_rows(m) + quantize_rows(m)
    if args.out:
        write_json(args.out, dict(run_info("fp8_handoff_bench"), rows=rows))


if __name__ == "__main__":
    main()
