"""One mixture-of-experts layer on a GPU: the router projection plus kernels/moe.py's fused_moe (route,
align, gate_up + SiLU-and-mul, down + routing weights, combine), bf16, timed inside a CUDA graph over
enough layer copies that L2 holds none of them. Reports us per layer and the bandwidth achieved against
the bytes a layer must read at that batch: the distinct experts the batch's routing chose times an
expert's bytes, plus the router weight. --sweep also times a grid of tiles at --sweep-tokens: for each
block_m, the gate_up tiles (down at its default shape), then the down tiles beside the best gate_up.
At decode sizes (up to SMALL_BATCH_MAX_TOKENS) the GEMV path (kernels/moe_gemv.py) and the grouped GEMMs are
each timed too, beside the path fused_moe takes ("default"); --sweep sweeps the GEMV path's tiles up to
GEMV_MAX_TOKENS. --kernels adds each kernel's device time a layer (the torch profiler over eager calls).

    python benchmarks/moe_kernel_bench.py --out benchmarks/results/moe_kernel_bench-h200-<date>.json
    python benchmarks/moe_kernel_bench.py --shapes qwen3-30b-a3b --tokens 1 16 --out moe.json
    python benchmarks/moe_kernel_bench.py --sweep --sweep-tokens 1 64 --out moe-sweep.json
    python benchmarks/moe_kernel_bench.py --shapes qwen3-30b-a3b --tokens 1 --kernels --out moe-kernels.json

gpt-oss shapes (--shapes gpt-oss-20b gpt-oss-120b): the router projection (with its bias) plus
kernels/gpt_oss_experts.py's experts, MXFP4 as stored (random bytes, scales as the dummy loader draws them),
bf16 rows, the bytes a layer must read counted as stored (4.25 bits a weight, the biases). Each path that takes
the batch is timed at its default tiles, the one gpt_oss_experts picks marked "(default)": "gemv"
(kernels/gpt_oss_gemv.py, 1-2 tokens), "small" (no alignment, up to 16 tokens) and "grouped" (moe_align at every
size: the path first measured, at its first tiles). --sweep sweeps the tiles of the tensor-core path each
--sweep-tokens batch takes (K tiles to 128 bytes a row), and of the GEMV path at 1-2 tokens.

    python benchmarks/moe_kernel_bench.py --shapes gpt-oss-20b --tokens 1 2 4 8 16 64 --kernels --out oss.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure import copy_bandwidth, graph_ms, run_info, write_json  # noqa: E402

BF16 = torch.bfloat16
SHAPES = {  # name: (hidden, inter, experts, top_k, renormalize)
    "qwen3-30b-a3b": (2048, 768, 128, 8, True),
    "mixtral-8x7b": (4096, 14336, 8, 2, True),
}
GPT_OSS_SHAPES = {  # name: (hidden, inter, experts, top_k); MXFP4 experts, softmax over the top k
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "gpt-oss-120b": (2880, 2880, 128, 4),
}
# layer copies cycled through in the graph, at least this many bytes of experts in all (L2: 50 MB an H200)
MIN_BYTES = 2 * 2**30


def kernel_times(layer_call, copies: int, calls: int = 60) -> dict[str, float]:
    """Device time a layer of each kernel (name: us), from the profiler over `calls` eager calls
    cycling through the layer copies: where a layer's time goes (the graph runs the same kernels)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(copies):  # compiled and warm
        layer_call(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            layer_call(i % copies)
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if us > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.key[:90]] = totals.get(event.key[:90], 0.0) + us / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def bench_shape(name: str, tokens_list: list[int], copy_gbs: float, sweep_tokens: list[int],
                profile: bool = False) -> list[dict]:
    from graphserve.kernels.launch_settings import sm_count
    from graphserve.kernels.moe import SMALL_BATCH_MAX_TOKENS, default_moe_tiles, fused_moe, route
    from graphserve.kernels.moe_gemv import GEMV_MAX_TOKENS

    hidden, inter, experts, top_k, renormalize = SHAPES[name]
    expert_bytes = 3 * hidden * inter * 2
    router_bytes = experts * hidden * 2
    copies = max(2, -(-MIN_BYTES // (experts * expert_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(copies):
        gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).to(BF16)
        down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5).to(BF16)
        router = (torch.randn(experts, hidden, device="cuda", generator=gen) / hidden**0.5).to(BF16)
        layers.append((router, gate_up, down))
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(BF16)
        # the bytes each copy must read: its own routing's distinct experts
        chosen = [route(F.linear(x, r), top_k, renormalize)[1].unique().numel() for r, _, _ in layers]
        must_read = sum(c * expert_bytes + router_bytes for c in chosen) / copies

        def time_tiles(tiles, quiet_errors: bool = False, gemv: bool | None = None) -> float | None:
            def layer_fn(i):
                router, gate_up, down = layers[i]
                return lambda: fused_moe(x, F.linear(x, router), gate_up, down, top_k, renormalize, tiles=tiles,
                                         gemv=gemv)
            try:
                return graph_ms([layer_fn(i) for i in range(copies)], min_calls=max(40, 2 * copies)) * 1e3
            except Exception as e:  # a swept tile that does not compile or fit
                if not quiet_errors:
                    raise
                print(f"  {name} T={tokens} {tiles}: {type(e).__name__}: {str(e)[:100]}")
                return None

        def record(kind: str, tiles, us: float) -> dict:
            row = dict(shape=name, tokens=tokens, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                       kind=kind, tiles=[list(t) for t in tiles] if tiles else None, experts_chosen=sum(chosen) / copies,
                       bytes_must_read=must_read, us=us, gb_per_s=must_read / us / 1e3,
                       fraction_of_copy=must_read / us / 1e3 / copy_gbs)
            rows.append(row)
            return row

        default = default_moe_tiles(tokens, top_k, experts, hidden, inter, sm_count(x.device))
        # default: the path fused_moe takes at this size; at decode sizes each path forced as well
        timings = [("default", None, time_tiles(None))]
        if tokens <= SMALL_BATCH_MAX_TOKENS:
            timings += [("gemv", None, time_tiles(None, gemv=True)), ("grouped", default, time_tiles(default))]
        for kind, tiles, us in timings:
            row = record(kind, tiles, us)
            print(f"{name:14s} T={tokens:5d} {kind:8s} experts read {row['experts_chosen']:6.1f} {row['us']:9.1f} "
                  f"us/layer {row['gb_per_s']:7.0f} GB/s ({row['fraction_of_copy']:.0%} of copy)", flush=True)
        if tokens in sweep_tokens:
            sweep(tokens, default, time_tiles, record)
            if tokens <= GEMV_MAX_TOKENS:
                sweep_gemv(tokens, layers, x, top_k, renormalize, copies, record)
        if profile:
            kernels = kernel_times(lambda i: fused_moe(x, F.linear(x, layers[i][0]), layers[i][1], layers[i][2],
                                                       top_k, renormalize), copies)
            rows.append(dict(shape=name, tokens=tokens, kind="kernels", us_per_layer=kernels))
            print_kernel_times(kernels, "eager")
        del x
    del layers
    torch.cuda.empty_cache()
    return rows


def print_kernel_times(kernels: dict[str, float], how: str) -> None:
    print(f"  device time a layer by kernel ({how}, {sum(kernels.values()):.1f} us in all):", flush=True)
    for kernel, us in kernels.items():
        print(f"    {us:8.2f} us  {kernel}", flush=True)


def sweep_pair(pair, candidates, time_pair, record, label: str, best: tuple):
    """gate_up's candidates beside pair's down, then down's beside the best gate_up; each timing recorded.
    Returns the better of `best` and the sweep's best, as (us, tile pair)."""
    for which in (0, 1):
        timed = []
        for tile in candidates:
            tiles = (tile, pair[1]) if which == 0 else (pair[0], tile)
            us = time_pair(tiles)
            if us is not None:
                record(f"{label} {('gate_up', 'down')[which]}", tiles, us)
                timed.append((us, tiles))
        if timed:
            us, pair = min(timed, key=lambda t: t[0])
            if us < best[0]:
                best = (us, pair)
    return best


def sweep_gemv(tokens: int, layers, x, top_k: int, renormalize: bool, copies: int, record) -> None:
    """The decode path's tiles (kernels/moe_gemv.py): gate_up's with down's at their default, then
    down's beside the best gate_up; prints the best pair."""
    from graphserve.kernels.launch_settings import sm_count
    from graphserve.kernels.gemv import GemvTile
    from graphserve.kernels.moe_gemv import default_gemv_tiles, experts_gemv
    from graphserve.kernels.moe_route import route_fused

    hidden, inter = x.shape[1], layers[0][2].shape[2]

    def time_gemv(tiles) -> float | None:
        def layer_fn(i):
            router, gate_up, down = layers[i]

            def layer():
                weights, ids = route_fused(F.linear(x, router), top_k, renormalize)
                return experts_gemv(x, weights, ids, gate_up, down, None, None, tiles)
            return layer
        try:
            return graph_ms([layer_fn(i) for i in range(copies)], min_calls=max(40, 2 * copies)) * 1e3
        except Exception as e:  # a tile that does not compile or fit
            print(f"  T={tokens} {tiles}: {type(e).__name__}: {str(e)[:100]}")
            return None

    default = default_gemv_tiles(tokens, top_k, hidden, inter, sm_count(x.device))
    best = (time_gemv(default), default)
    candidates = [GemvTile(block_n, block_k, warps)
                  for block_n, block_k, warps in itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024), (4, 8))]
    best = sweep_pair(default, candidates, time_gemv, record, "sweep gemv", best)
    print(f"  best of the gemv sweep {best[0]:9.1f} us/layer {[list(t) for t in best[1]]} "
          f"(default {[list(t) for t in default]})", flush=True)


def sweep(tokens: int, default, time_tiles, record) -> None:
    """For each block_m (16 only up to SMALL_BATCH_MAX_TOKENS tokens: larger blocks only pad more): gate_up
    tiles with down at its default shape, then down tiles beside the best gate_up; prints the best pair."""
    from graphserve.kernels.moe import SMALL_BATCH_MAX_TOKENS, MoeTile

    best = (time_tiles(default), default)
    for block_m in (16,) if tokens <= SMALL_BATCH_MAX_TOKENS else (16, 32, 64):
        candidates = [MoeTile(block_m, block_n, block_k, 8 if block_n == 128 else 4, stages)
                      for block_n, block_k, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 4))]
        pair = (default[0]._replace(block_m=block_m), default[1]._replace(block_m=block_m))
        best = sweep_pair(pair, candidates, lambda tiles: time_tiles(tiles, quiet_errors=True), record, "sweep", best)
    print(f"  best of sweep {best[0]:9.1f} us/layer {[list(t) for t in best[1]]}", flush=True)


def bench_gpt_oss(name: str, tokens_list: list[int], copy_gbs: float, sweep_tokens: list[int],
                  profile: bool = False) -> list[dict]:
    """gpt-oss's MLP a layer (router + experts, MXFP4), each path that takes each batch; see the
    module's docstring."""
    from graphserve.kernels import gpt_oss_experts as oss
    from graphserve.kernels.gpt_oss_gemv import GEMV_MAX_TOKENS, default_gemv_tiles
    from graphserve.kernels.launch_settings import sm_count
    from graphserve.kernels.moe_route import route_fused

    hidden, inter, experts, top_k = GPT_OSS_SHAPES[name]
    expert_bytes = 2 * inter * hidden * 17 // 32 + hidden * inter * 17 // 32 + (2 * inter + hidden) * 2
    router_bytes = (experts * hidden + experts) * 2
    copies = max(2, -(-MIN_BYTES // (experts * expert_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randint(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=gen, device="cuda", dtype=torch.uint8)

    def randn(*shape, std):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).to(BF16)

    layers = [dict(router=randn(experts, hidden, std=hidden**-0.5), router_bias=randn(experts, std=0.02),
                   gate_up=randint(0, 256, experts, 2 * inter, hidden // 2),
                   gate_up_scales=randint(118, 121, experts, 2 * inter, hidden // 32),
                   down=randint(0, 256, experts, hidden, inter // 2),
                   down_scales=randint(118, 121, experts, hidden, inter // 32),
                   gate_up_bias=randn(experts, 2 * inter, std=0.02), down_bias=randn(experts, hidden, std=0.02))
              for _ in range(copies)]
    num_sms = sm_count(torch.device("cuda"))
    rows = []
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(BF16)
        chosen = [route_fused(F.linear(x, c["router"], c["router_bias"]), top_k, True)[1].unique().numel()
                  for c in layers]
        must_read = sum(n * expert_bytes + router_bytes for n in chosen) / copies

        def layer_fn(i, **kwargs):
            c = layers[i]

            def layer():
                weights, ids = route_fused(F.linear(x, c["router"], c["router_bias"]), top_k, True)
                return oss.gpt_oss_experts(x, weights, ids, c["gate_up"], c["down"], c["gate_up_bias"], c["down_bias"],
                                           1.702, 7.0, gate_up_scales=c["gate_up_scales"],
                                           down_scales=c["down_scales"], **kwargs)
            return layer

        def time_layer(quiet_errors: bool = False, **kwargs) -> float | None:
            try:
                return graph_ms([layer_fn(i, **kwargs) for i in range(copies)], min_calls=max(40, 2 * copies)) * 1e3
            except Exception as e:  # a swept tile that does not compile or fit
                if not quiet_errors:
                    raise
                print(f"  {name} T={tokens} {kwargs}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                return None

        def record(kind: str, tiles, us: float | None) -> dict:
            row = dict(shape=name, tokens=tokens, hidden=hidden, inter=inter, experts=experts, top_k=top_k,
                       kind=kind, tiles=[list(t) for t in tiles] if tiles else None,
                       experts_chosen=sum(chosen) / copies, bytes_must_read=must_read, us=us,
                       gb_per_s=must_read / us / 1e3 if us else None,
                       fraction_of_copy=must_read / us / 1e3 / copy_gbs if us else None)
            rows.append(row)
            if us:
                print(f"{name:13s} T={tokens:4d} {kind:30s} experts read {row['experts_chosen']:5.1f} {us:8.1f} us/layer "
                      f"{row['gb_per_s']:6.0f} GB/s ({row['fraction_of_copy']:.0%} of copy)", flush=True)
            return row

        default_path = oss.pick_path(tokens, True)
        paths = [p for p, most in (("gemv", GEMV_MAX_TOKENS), ("small", oss.SMALL_BATCH_MAX_TOKENS),
                                   ("grouped", tokens)) if tokens <= most]
        for path in paths:
            tiles = (default_gemv_tiles(tokens, top_k, hidden, inter, num_sms) if path == "gemv" else
                     oss.gpt_oss_tiles(tokens, top_k, experts, hidden, inter, num_sms, 2, True, path == "small"))
            label = f"{path} (default)" if path == default_path else path
            record(label, tiles, time_layer(path=path, tiles=tiles, quiet_errors=path != default_path))
        if tokens in sweep_tokens:
            path = "small" if tokens <= oss.SMALL_BATCH_MAX_TOKENS else "grouped"
            sweep_gpt_oss(tokens, path, time_layer, record,
                          oss.gpt_oss_tiles(tokens, top_k, experts, hidden, inter, num_sms, 2, True, path == "small"))
            if tokens <= GEMV_MAX_TOKENS:
                sweep_gpt_oss_gemv(tokens, time_layer, record, default_gemv_tiles(tokens, top_k, hidden, inter, num_sms))
        if profile:
            kernels = kernel_times(lambda i: layer_fn(i)(), copies)
            rows.append(dict(shape=name, tokens=tokens, kind="kernels", path=default_path, us_per_layer=kernels))
            print_kernel_times(kernels, f"{default_path}, eager")
        del x
    del layers
    torch.cuda.empty_cache()
    return rows


def sweep_gpt_oss(tokens: int, path: str, time_layer, record, default) -> None:
    """The tensor-core path's tiles: gate_up's beside down's default, then down's beside the best."""
    from graphserve.kernels.moe import MoeTile

    block_m = default[0].block_m
    candidates = [MoeTile(block_m, block_n, block_k, 8 if block_n == 128 else 4, stages)
                  for block_n, block_k, stages in itertools.product((16, 32, 64, 128), (64, 128, 256), (3, 4))]
    best = sweep_pair(default, candidates, lambda tiles: time_layer(path=path, tiles=tiles, quiet_errors=True),
                      record, f"sweep {path}", (float("inf"), default))
    print(f"  best of the {path} sweep {best[0]:8.1f} us/layer {[list(t) for t in best[1]]}", flush=True)


def sweep_gpt_oss_gemv(tokens: int, time_layer, record, default) -> None:
    from graphserve.kernels.gpt_oss_gemv import GptOssGemvTile

    candidates = [GptOssGemvTile(block_n, block_k, warps)
                  for block_n, block_k, warps in itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4))]
    best = sweep_pair(default, candidates, lambda tiles: time_layer(path="gemv", tiles=tiles, quiet_errors=True),
                      record, "sweep gemv", (float("inf"), default))
    print(f"  best of the gemv sweep {best[0]:8.1f} us/layer {[list(t) for t in best[1]]}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES) + sorted(GPT_OSS_SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles at --sweep-tokens")
    parser.add_argument("--sweep-tokens", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--kernels", action="store_true",
                        help="also each kernel's device time a layer (torch profiler, eager calls)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    copy = copy_bandwidth()
    rows = []
    for name in args.shapes:
        bench = bench_gpt_oss if name in GPT_OSS_SHAPES else bench_shape
        with torch.no_grad():
            rows += bench(name, args.tokens, copy["gb_per_s"], args.sweep_tokens if args.sweep else [], args.kernels)
    write_json(args.out, dict(**run_info("moe_kernel_bench"), copy=copy, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
