"""CPU projections over GGUF-quantized weights (engine/cpu/quant_linear.py) against the float32
panels (engine/cpu/linear.py), over the embedded model's real shapes: 30 layers of fresh weights
(qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and its LM head (49152x576), at each
row count: the best of --repeats runs, the kinds taking turns (the machine's noise is shared). The
kinds' weights, about 1 GB together, evict each other between passes, so every pass reads its
weights from memory; a served 4-bit model alone (66 MB) may partly stay in a large L3 and run
faster (Q4_1 at 1 row: 2.6 ms per pass when its weights were the only ones, against 3.9 here). Bandwidth = the bytes of the 30 layers' packed
weights / the time of a pass. Rows above 32 (prefill) also time torch's F.linear (MKL) on the
float32 weight, the path float32 prefill takes.

    python benchmarks/cpu_quant_bench.py [--rows 1 4 8 16 70 128] [--types Q8_0 Q4_0 Q4_1 Q4_K Q6_K]
                                         [--threads 2] [--repeats 7] [--out FILE]

The quantized weights are random blocks with small float16 scales: the time does not depend on
the values. Q4_K and Q6_K blocks are 256 wide and 576 is not a multiple of 256 (llama.cpp's
Q4_K_M files of this model store those tensors in other types): they run on the same shapes with
K rounded up to 768 (`layer_shapes` in the JSON), so compare them by GB/s and weights per second.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from graphserve.engine.cpu import linear as cpu_linear  # noqa: E402
from graphserve.engine.cpu import quant_linear  # noqa: E402
from workload import provenance, write_json  # noqa: E402

# SmolLM2-135M (the embedded model): hidden 576, 9 + 2 x 3 heads of 64, MLP 1536, 30 layers
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
# GGUF block: (values, bytes, byte offsets of float16 scales inside it)
BLOCKS = {"Q8_0": (32, 34, (0,)), "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)),
          "Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,))}


def random_gguf(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    values, size, scales = BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    for at in scales:
        scale = np.full(blocks.shape[:2], 1e-3, np.float16)
        blocks[..., at:at + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(n, -1)


def shapes(qtype: str) -> dict[str, tuple[int, int]]:
    """The layer's shapes, K rounded up to whole blocks of the type."""
    values = BLOCKS[qtype][0] if qtype in BLOCKS else 1
    return {name: (n, -(-k // values) * values) for name, (n, k) in LAYER.items()}


def best_ms(fn, best: float) -> float:
    start = time.perf_counter()
    fn()
    return min(best, (time.perf_counter() - start) * 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 70, 128])
    parser.add_argument("--types", nargs="+", default=list(BLOCKS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                             / f"cpu_quant_bench-cpu-{time.strftime('%Y-%m-%d')}.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not (cpu_linear.available() and quant_linear.available()):
        print("the C kernels are unavailable here (no C compiler)", file=sys.stderr)
        return 1
    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    floats = [{name: torch.randn(shape, generator=gen) * 0.02 for name, shape in LAYER.items()} for _ in range(LAYERS)]
    float_head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02
    weights = {"float32": [{name: cpu_linear.pack_panels(w) for name, w in layer.items()} for layer in floats]}
    heads = {"float32": cpu_linear.pack_panels(float_head)}
    for qtype in args.types:
        weights[qtype] = [{name: quant_linear.pack_quantized(random_gguf(qtype, n, k, rng), qtype, n, k)
                           for name, (n, k) in shapes(qtype).items()} for _ in range(LAYERS)]
        head_k = -(-HIDDEN // BLOCKS[qtype][0]) * BLOCKS[qtype][0]
        heads[qtype] = quant_linear.pack_quantized(random_gguf(qtype, VOCAB, head_k, rng), qtype, VOCAB, head_k)
    layer_bytes = {kind: sum(w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes
                             for layer in layers for w in layer.values()) for kind, layers in weights.items()}

    def project(kind: str, x: torch.Tensor, w, n: int) -> torch.Tensor:
        if kind == "float32":
            return cpu_linear.panel_linear(x, w, n)
        if kind == "torch-float32":
            return F.linear(x, w)
        return quant_linear.quant_linear(x, w)

    rows_out = []
    for rows in args.rows:
        kinds = list(weights) + (["torch-float32"] if rows > cpu_linear.MAX_ROWS else [])
        if rows > cpu_linear.MAX_ROWS:
            weights["torch-float32"], heads["torch-float32"] = floats, float_head
            layer_bytes["torch-float32"] = layer_bytes["float32"]
            kinds.remove("float32")  # the panels take 1-32 rows only
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 768, 1536)}
        best = {kind: [float("inf"), float("inf")] for kind in kinds}
        for _ in range(args.repeats):
            for kind in kinds:
                def layers(kind=kind):
                    for layer in weights[kind]:
                        for name, (n, k) in shapes(kind).items():
                            project(kind, xs[k], layer[name], n)

                best[kind][0] = best_ms(layers, best[kind][0])
                head_k = shapes(kind)["qkv"][1]
                best[kind][1] = best_ms(lambda kind=kind: project(kind, xs[head_k], heads[kind], VOCAB), best[kind][1])
        for kind, (layers_ms, head_ms) in best.items():
            gbps = layer_bytes[kind] / layers_ms / 1e6
            weights_per_pass = LAYERS * sum(n * k for n, k in shapes(kind).values())
            rows_out.append(dict(kind=kind, rows=rows, layers_ms=layers_ms, lm_head_ms=head_ms,
                                 layer_shapes=shapes(kind), layer_weight_bytes=layer_bytes[kind], layers_gb_per_s=gbps,
                                 layers_gweights_per_s=weights_per_pass / layers_ms / 1e6,
                                 speedup_vs_float32=best.get("float32", best.get("torch-float32"))[0] / layers_ms))
            print(f"{kind:13s} rows {rows:3d}: 30 layers {layers_ms:6.2f} ms ({gbps:5.1f} GB/s, "
                  f"{layer_bytes[kind] / 1e6:5.1f} MB), LM head {head_ms:5.2f} ms", flush=True)
    result = provenance("cpu_quant_bench") | dict(threads=args.threads, repeats=args.repeats, rows=rows_out)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
        result["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
        flags = next(line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags"))
        result["cpu_flags"] = [f for f in flags if f.startswith(("avx512", "avx_vnni", "fma", "avx2"))]
    except (OSError, StopIteration):
        pass
    result["kernel_build"] = quant_linear.LIBRARY.isa()
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
