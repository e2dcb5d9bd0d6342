"""Decode-attention bandwidth against the GPU's device-to-device copy bandwidth.

    python benchmarks/kernel_bench.py [--out PATH] [--sweep]

Copy bandwidth: bytes read + written by a large tensor copy / time (triton.testing.do_bench
median). Decode attention: KV bytes read (context tokens x KV heads x head_dim x 2 tensors x
2 bytes) / time, as a fraction of the copy bandwidth. Decode is timed per call inside a CUDA
graph (as the engine runs it; CUDA events, median of replays, rotating over enough cache copies
that L2 does not serve repeats) and, for the default launch, also with do_bench (launch overhead
included). --sweep also times other tile shapes and split counts. Needs CUDA.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure import bench_ms, copy_bandwidth, graph_ms, run_info, write_json  # noqa: E402

# (name, batch, context, q heads, kv heads, head_dim)
CASES = [
    ("llama8b-b64-ctx4096", 64, 4096, 32, 8, 128),
    ("llama8b-b1-ctx32768", 1, 32768, 32, 8, 128),
    ("llama8b-b8-ctx8192", 8, 8192, 32, 8, 128),
    ("qwen0.5b-b64-ctx4096", 64, 4096, 14, 2, 64),
]
TARGET_FRACTION = 0.70
# prefill (informational): (name, new tokens per sequence, cached prefix per sequence), Llama-3.1-8B heads
PREFILL_CASES = [
    ("llama8b-prefill-4x2048", [2048] * 4, [0] * 4),
    ("llama8b-chunk-1024-after-7168", [1024], [7168]),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    today = dt.date.today().isoformat()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / f"kernel_bench-{today}.json",
                   help="where to write the JSON results (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache page size in tokens")
    p.add_argument("--copy-mib", type=int, default=2048, help="size of the copied buffer in MiB")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time in ms")
    p.add_argument("--sweep", action="store_true", help="also time other tile shapes and split counts")
    p.add_argument("--case", action="append", default=[], metavar="NAME,BATCH,CONTEXT,HQ,HKV,HEAD_DIM",
                   help="decode cases to run instead of the defaults (repeatable)")
    return p.parse_args(argv)


def decode_inputs(batch: int, ctx: int, hq: int, hkv: int, head_dim: int, block_size: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_blocks = -(-ctx // block_size)
    num_blocks = batch * max_blocks + 1
    shape = (num_blocks, block_size, hkv, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    # scattered pages, as after a while of serving
    block_tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).reshape(batch, max_blocks)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k_cache, v_cache, block_tables.to(torch.int32), context_lens


def bench_decode(case: tuple, block_size: int, rep: int, copy_gbs: float, sweep: bool) -> list[dict]:
    from graphserve.kernels.launch_settings import sm_count
    from graphserve.kernels.decode_attention import (
        DecodeTile,
        default_decode_tile,
        paged_decode_attention,
        pick_num_splits,
    )

    name, batch, ctx, hq, hkv, head_dim = case
    kv_bytes = batch * ctx * hkv * head_dim * 2 * 2
    # enough distinct caches that a graph's back-to-back calls do not hit in L2 (60 MB)
    copies = max(1, min(8, -(-512 * 2**20 // kv_bytes)))
    inputs = [decode_inputs(batch, ctx, hq, hkv, head_dim, block_size, seed=i) for i in range(copies)]
    outs = [torch.empty_like(inp[0]) for inp in inputs]
    max_context = inputs[0][3].shape[1] * block_size
    default_splits = pick_num_splits(batch, hkv, max_context, sm_count(outs[0].device))
    default_tile = default_decode_tile(head_dim)

    def make_fn(i, splits, tile):
        q, k_cache, v_cache, bt, cl = inputs[i]
        return lambda: paged_decode_attention(q, k_cache, v_cache, bt, cl, head_dim**-0.5,
                                              num_splits=splits, out=outs[i], tile=tile)

    variants = [(default_splits, default_tile)]
    if sweep:
        tiles = [DecodeTile(*t) for t in ((32, 4, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3), (64, 8, 3),
                                          (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3))]
        split_counts = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128) if s * 32 <= ctx]
        variants += [(s, t) for t in tiles for s in split_counts if (s, t) != variants[0]]
    rows = []
    for splits, tile in variants:
        fns = [make_fn(i, splits, tile) for i in range(copies)]
        try:
            g_ms = graph_ms(fns)
            launch_ms = bench_ms(fns[0], rep) if (splits, tile) == variants[0] else None
        except Exception as e:  # a tile shape that does not fit (shared memory) in a sweep
            print(f"  {name} splits={splits} tile={tile}: {type(e).__name__}: {str(e)[:120]}")
            continue
        row = {
            "case": name, "batch": batch, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": head_dim,
            "block_size": block_size, "num_splits": splits, "tile": list(tile),
            "default": (splits, tile) == variants[0], "kv_bytes": kv_bytes,
            "graph_ms": g_ms, "graph_gb_per_s": kv_bytes / g_ms / 1e6,
            "fraction_of_copy": kv_bytes / g_ms / 1e6 / copy_gbs,
        }
        if launch_ms is not None:
            row.update(launch_ms=launch_ms, launch_gb_per_s=kv_bytes / launch_ms / 1e6,
                       launch_fraction_of_copy=kv_bytes / launch_ms / 1e6 / copy_gbs)
        rows.append(row)
    del inputs, outs
    torch.cuda.empty_cache()
    return rows


def bench_prefill(case: tuple, block_size: int, rep: int, sweep: bool) -> list[dict]:
    from graphserve.kernels.prefill_attention import (
        PrefillTile,
        default_prefill_tile,
        paged_prefill_attention,
    )

    name, q_lens, prefixes = case
    hq, hkv, head_dim = 32, 8, 128
    ctx_lens = [n + p for n, p in zip(q_lens, prefixes)]
    _, k_cache, v_cache, bt, _ = decode_inputs(len(q_lens), max(ctx_lens), hq, hkv, head_dim, block_size)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device="cuda")
    cu[1:] = torch.tensor(q_lens, device="cuda").cumsum(0)
    cl = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    # query/key pairs visible under the causal mask; QK^T and PV are 2 flops per pair and dim each
    pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(q_lens, prefixes))
    flops = 4 * hq * head_dim * pairs
    default = default_prefill_tile(head_dim, q.dtype)
    tiles = [default]
    if sweep:
        tiles += [PrefillTile(*t) for t in ((64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2),
                                            (64, 32, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2))]
    rows = []
    for tile in tiles:
        try:
            ms = bench_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, bt, cu, cl, max(q_lens),
                                                          head_dim**-0.5, out=out, tile=tile), rep)
        except Exception as e:
            print(f"  {name} tile={tile}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append({"case": name, "q_lens": q_lens, "prefixes": prefixes, "tile": list(tile),
                     "default": tile == default, "ms": ms, "tflop_per_s": flops / ms / 1e9})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU", file=sys.stderr)
        return 2

    copy = copy_bandwidth(args.copy_mib, args.rep)
    print(f"device-to-device copy: {copy['gb_per_s']:.0f} GB/s "
          f"({copy['ms']:.3f} ms for {copy['bytes_moved'] / 1e9:.2f} GB)")
    cases = [(c.split(",")[0], *map(int, c.split(",")[1:])) for c in args.case] or CASES
    rows = []
    for case in cases:
        rows += bench_decode(case, args.block_size, args.rep, copy["gb_per_s"], args.sweep)

    print(f"{'case':22} {'splits':>6} {'tile (bn,w,st)':>15} {'graph ms':>9} {'GB/s':>6} {'of copy':>8}"
          f" {'launch ms':>10} {'of copy':>8}")
    for case in cases:
        mine = [r for r in rows if r["case"] == case[0]]
        shown = [r for r in mine if r["default"]] + sorted((r for r in mine if not r["default"]),
                                                          key=lambda r: r["graph_ms"])[:6]
        for r in shown:
            launch = (f"{r['launch_ms']:>10.4f} {r['launch_fraction_of_copy']:>7.1%}" if "launch_ms" in r else "")
            print(f"{r['case']:22} {r['num_splits']:>6} {str(tuple(r['tile'])):>15} {r['graph_ms']:>9.4f} "
                  f"{r['graph_gb_per_s']:>6.0f} {r['fraction_of_copy']:>7.1%}{'*' if r['default'] else ' '}{launch}")
    print(f"(* default launch, then the fastest sweep variants; graph: per call inside a CUDA graph over "
          f"rotating caches; launch: do_bench median with L2 flush; target >= {TARGET_FRACTION:.0%} of copy)")

    prefill_rows = []
    for case in PREFILL_CASES if not args.case else []:
        prefill_rows += bench_prefill(case, args.block_size, args.rep, args.sweep)
    print(f"\n{'prefill case':32} {'tile (bm,bn,w,st)':>18} {'ms':>8} {'TFLOP/s':>8}")
    for r in sorted(prefill_rows, key=lambda r: (r["case"], not r["default"], r["ms"])):
        print(f"{r['case']:32} {str(tuple(r['tile'])):>18} {r['ms']:>8.3f} {r['tflop_per_s']:>8.1f}"
              f"{'*' if r['default'] else ''}")

    result = {
        **run_info("kernel_bench"),
        "copy": copy,
        "decode_attention": rows,
        "prefill_attention": prefill_rows,
        "target_fraction_of_copy": TARGET_FRACTION,
    }
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
