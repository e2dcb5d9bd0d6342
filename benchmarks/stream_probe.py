"""Why one-row FP8 projections stream slower than bf16 ones: each projection's weights read with the
one-row GEMV's own tile walk (kernels/gemv.py default_gemv_tile: BLOCK_N rows, BLOCK_K elements a tile,
the next tile loaded before the PDL wait and then one iteration ahead) but with no arithmetic (the
words only XOR-ed together), beside the GEMV itself, for bf16 and FP8 weights of the same shape.
Also the same bytes as a few other row-segment shapes (--segments). Needs CUDA.

    python benchmarks/stream_probe.py [--models llama-3.1-8b] [--out PATH]

If the bare stream of FP8 weights already stops where the FP8 GEMV does (about 3.6 TB/s of an H200's
4.3, 2026-12-02), the access pattern bounds it, not the math; if it runs at the bf16 rate, the
kernel's work does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from gemv_bench import SHAPES, make_inputs, projections  # noqa: E402
from measure import copy_bandwidth, graph_ms, run_info, write_json  # noqa: E402

from graphserve.kernels._pdl import wait_for_previous_kernel  # noqa: E402


@triton.jit
def _stream_rows_kernel(w_ptr, out_ptr, N, K_WORDS, stride_w_words,
                        PDL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """XOR of each row's 32-bit words (w_ptr viewed as int32), read as the GEMV reads its weights."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_w_words
    offs = tl.arange(0, BLOCK_W)
    w = tl.load(rows + offs[None, :], mask=n_mask[:, None] & (offs < K_WORDS)[None, :], other=0)
    if PDL:
        wait_for_previous_kernel()
    acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.int32)
    for k0 in range(0, K_WORDS, BLOCK_W):
        acc = acc ^ w
        nxt = k0 + BLOCK_W + offs
        w = tl.load(rows + nxt[None, :], mask=n_mask[:, None] & (nxt < K_WORDS)[None, :], other=0)
    tl.store(out_ptr + offs_n, tl.xor_sum(acc, 1), mask=n_mask)


def stream_rows(weight: torch.Tensor, out: torch.Tensor, block_n: int, block_bytes: int, num_warps: int) -> None:
    """out [N] int32: the XOR of each row's words of `weight` [N, K] (contiguous rows, K * element size
    a multiple of 4), block_n rows and block_bytes bytes of each a tile."""
    words = weight.view(torch.uint8).view(torch.int32) if weight.element_size() == 1 else weight.view(torch.int32)
    n, k_words = words.shape
    pdl = weight.is_cuda
    _stream_rows_kernel[(triton.cdiv(n, block_n),)](
        words, out, n, k_words, words.stride(0),
        PDL=pdl, BLOCK_N=block_n, BLOCK_W=max(1, block_bytes // 4), num_warps=num_warps, launch_pdl=pdl)


def stream_rows_ref(weight: torch.Tensor) -> torch.Tensor:
    words = weight.view(torch.uint8).view(torch.int32) if weight.element_size() == 1 else weight.view(torch.int32)
    out = torch.zeros(words.shape[0], dtype=torch.int32, device=words.device)
    for j in range(words.shape[1]):
        out ^= words[:, j]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama-3.1-8b"], choices=list(SHAPES))
    p.add_argument("--projections", nargs="+", default=["qkv", "o", "gate_up", "down"])
    p.add_argument("--segments", nargs="+", default=["1,1024,4", "1,2048,8", "2,1024,4", "4,2048,4", "8,512,4"],
                   help="other tiles for the bare stream: rows,bytes,warps each")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results" / f"stream_probe-{dt.date.today()}.json")
    args = p.parse_args()

    from graphserve.kernels._common import sm_count
    from graphserve.kernels.gemv import default_gemv_tile, gemv

    copy = copy_bandwidth(2048, 100)
    print(f"device-to-device copy: {copy['gb_per_s']:.0f} GB/s")
    sms = sm_count(torch.device("cuda"))
    rows = []
    for model in args.models:
        for name, n, k, norm, bias, silu in projections(model):
            if name not in args.projections:
                continue
            for weights in ("bf16", "fp8"):
                fp8 = weights == "fp8"
                elt = 1 if fp8 else 2
                nbytes = n * k * elt
                copies = max(2, min(64, -(-256 * 2**20 // nbytes)))
                x, res, g, ws, biases = make_inputs(1, n, k, norm, bias, copies, fp8)
                tile = default_gemv_tile(1, n // 2 if silu else n, k, sms, silu, elt)
                outs = [torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(copies)]
                stream_rows(ws[0][0], outs[0], tile.block_n, tile.block_k * elt, tile.num_warps)
                assert torch.equal(outs[0], stream_rows_ref(ws[0][0]))  # every word read

                def record(kind, spec, fns):
                    ms = graph_ms(fns, min_calls=2 * copies)
                    gbs = nbytes / ms / 1e6
                    rows.append(dict(model=model, projection=name, weights=weights, n=n, k=k, kind=kind, tile=spec,
                                     us=ms * 1e3, gb_per_s=gbs, fraction_of_copy=gbs / copy["gb_per_s"]))
                    print(f"{model:13s} {weights} {name:8s} {kind:26s} {str(spec):18s} {ms * 1e3:7.2f} us "
                          f"{gbs:6.0f} GB/s ({gbs / copy['gb_per_s']:5.1%})", flush=True)

                record("gemv", list(tile), [
                    (lambda i=i: gemv(x, ws[i][0], biases[i] if biases else None, norm_weight=g, residual=res,
                                      silu_mul=silu, weight_scale=ws[i][1])) for i in range(copies)])
                # the GEMV's own walk: silu_mul reads a gate and an up row for each of block_n pairs
                walk = (tile.block_n * (2 if silu else 1), tile.block_k * elt, tile.num_warps)
                for spec in [walk] + [tuple(map(int, s.split(","))) for s in args.segments]:
                    record("stream (GEMV walk)" if spec == walk else "stream", list(spec), [
                        (lambda i=i, s=spec: stream_rows(ws[i][0], outs[i], *s)) for i in range(copies)])
                del ws, biases, outs
                torch.cuda.empty_cache()
    write_json(args.out, dict(**run_info("stream_probe"), copy=copy, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
