"""CPU projections at decode sizes: engine/cpu/linear.py's panel kernel against MKL (F.linear on
the plain weight) and oneDNN (a weight packed by torch.ops.mkldnn), over the embedded model's
30 layers of fresh weights (qkv, o, gate_up, down: more than the caches hold, as in a decode
step) and its LM head, at each row count: the best of --repeats runs, the kinds taking turns.

    python benchmarks/cpu_linear_bench.py [--rows 1 2 4 8 16 32] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from graphserve.engine.cpu import linear as cpu_linear  # noqa: E402
from workload import provenance, write_json  # noqa: E402

# SmolLM2-135M (the embedded model): hidden 576, 9 + 2 x 3 heads of 64, MLP 1536, 30 layers
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, VOCAB = 30, 49152


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_linear.available():
        print("the panel kernel is unavailable here (no C compiler)", file=sys.stderr)
        return 1
    gen = torch.Generator().manual_seed(0)
    weights = [{name: torch.randn(shape, generator=gen) * 0.02 for name, shape in LAYER.items()} for _ in range(LAYERS)]
    head = torch.randn(VOCAB, 576, generator=gen) * 0.02
    forms = {
        "mkl": lambda w: w,
        "onednn": lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 16),
        "panels": cpu_linear.pack_panels,
    }
    run = {
        "mkl": lambda x, w, n: F.linear(x, w),
        "onednn": lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "panels": lambda x, w, n: cpu_linear.panel_linear(x, w, n),
    }
    packed = {kind: [{name: form(w) for name, w in layer.items()} for layer in weights] for kind, form in forms.items()}
    packed_head = {kind: form(head) for kind, form in forms.items()}
    weight_bytes = 4 * LAYERS * sum(n * k for n, k in LAYER.values())
    rows_out = []
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        best = {kind: [float("inf"), float("inf")] for kind in forms}
        for _ in range(args.repeats):  # the kinds in turn, each one's best: the machine's noise is shared
            for kind in forms:
                def layers():
                    for layer in packed[kind]:
                        for name, (n, k) in LAYER.items():
                            run[kind](xs[k], layer[name], n)

                best[kind][0] = min(best[kind][0], timed(layers, 1))
                best[kind][1] = min(best[kind][1], timed(lambda: run[kind](xs[576], packed_head[kind], VOCAB), 1))
        for kind, (layers_ms, head_ms) in best.items():
            rows_out.append(dict(kind=kind, rows=rows, layers_ms=layers_ms, lm_head_ms=head_ms,
                                 layers_gb_per_s=weight_bytes / layers_ms / 1e6))
            print(f"{kind:7s} rows {rows:3d}: 30 layers {layers_ms:6.1f} ms "
                  f"({weight_bytes / layers_ms / 1e6:5.1f} GB/s), LM head {head_ms:5.1f} ms", flush=True)
    result = provenance("cpu_linear_bench") | dict(threads=args.threads, rows=rows_out)
    write_json(Path(args.out) / f"cpu_linear_bench-{time.strftime('%Y-%m-%d')}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
