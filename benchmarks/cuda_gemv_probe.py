"""How near the bandwidth limit a hand-written CUDA kernel gets on Llama-3.1-8B's FP8 projections at one row,
against the Triton GEMV the engine ships (kernels/gemv.py): the data for deciding whether the batch-1 FP8
target needs kernels outside Triton. Needs CUDA, nvcc and an sm_89+ GPU.

    python benchmarks/cuda_gemv_probe.py [--rows 1 8] [--out PATH]

benchmarks/cuda/fp8_mma_gemv.cu (built here with nvcc into a shared library, called through ctypes) multiplies
the e4m3 weights on the tensor cores straight from registers, by e4m3 activations (W8A8, a scale a weight row
and a scale an activation row, quantized by the engine's row kernel) or by the bf16 activations turned into
f16 (weight-only); the Triton GEMV reads the same weights with bf16 activations (weight-only).
Each is checked against a float32 reference first, then timed in a CUDA graph over enough distinct copies of
the weights that none is read from L2, with programmatic dependent launch, as decode runs it.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as dt
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure import copy_bandwidth, graph_ms, run_info, write_json  # noqa: E402

SOURCE = REPO / "benchmarks/cuda/fp8_mma_gemv.cu"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
VARIANTS = [(u, w) for u in (2, 4, 8) for w in (1, 2, 4, 8) if (u, w) != (8, 8)]  # (unroll, warps_k)
FP8_MAX = 448.0


def build(out_dir: Path) -> ctypes.CDLL:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    major, minor = torch.cuda.get_device_capability()
    lib = out_dir / "fp8_mma_gemv.so"
    out_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run([nvcc, "-O3", f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}", "-shared",
                    "-Xcompiler", "-fPIC", "-Xptxas", "-v", "-o", str(lib), str(SOURCE)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.fp8_mma_gemv.restype = ctypes.c_int
    dll.fp8_mma_gemv.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7 + [ctypes.c_void_p]
    return dll


def cuda_gemv(dll: ctypes.CDLL, w: torch.Tensor, w_scale: torch.Tensor, x: torch.Tensor, x_scale: torch.Tensor | None,
              y: torch.Tensor, unroll: int, warps_k: int) -> None:
    """x: e4m3 [M, K] with x_scale [M] (W8A8), or bf16 [M, K] with x_scale None (weight-only)."""
    n, k = w.shape
    weight_only = x_scale is None
    err = dll.fp8_mma_gemv(w.data_ptr(), w_scale.data_ptr(), x.data_ptr(), 0 if weight_only else x_scale.data_ptr(),
                           y.data_ptr(), n, k, x.shape[0], unroll, warps_k, int(weight_only), 1,
                           torch.cuda.current_stream().cuda_stream)
    if err:
        raise RuntimeError(f"fp8_mma_gemv failed ({err}) for {tuple(w.shape)} unroll={unroll} warps_k={warps_k}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results" / f"cuda_gemv_probe-{dt.date.today()}.json")
    p.add_argument("--build-dir", type=Path, default=Path("/tmp/graphserve-cuda-probe"))
    args = p.parse_args()
    from graphserve.kernels.fp8_quant import quantize_rows_fp8
    from graphserve.kernels.gemv import gemv

    dll = build(args.build_dir)
    dev = torch.device("cuda")
    copy = copy_bandwidth()
    print(f"copy {copy['gb_per_s']:.0f} GB/s", flush=True)
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, (n, k) in SHAPES.items():
        copies = max(4, -(-(1 << 30) // (n * k)))  # >= 1 GiB of weights: none of it left in L2
        weights = []
        for _ in range(copies):
            w = torch.randn(n, k, device=dev, generator=gen)
            w_scale = w.abs().amax(1) / FP8_MAX
            weights.append(((w / w_scale[:, None]).to(torch.float8_e4m3fn), w_scale.float().contiguous()))
        for m in args.rows:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            xq, x_scale = quantize_rows_fp8(x)  # the engine's per-row activation quantization
            x_scale = x_scale.view(-1)
            y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            w0, s0 = weights[0]
            want = (xq.float() * x_scale[:, None]) @ (w0.float() * s0[:, None]).T
            want_weight_only = x.float() @ (w0.float() * s0[:, None]).T
            got_triton = gemv(x, w0, weight_scale=s0)[0]
            err = ((got_triton.float() - want_weight_only).norm() / want_weight_only.norm()).item()
            assert err < 1e-2, f"Triton GEMV {name} m={m}: relative error {err}"

            def triton_run(x=x):
                for w, s in weights:
                    gemv(x, w, weight_scale=s)

            us = graph_ms([triton_run], min_calls=4) * 1e3 / copies
            row = dict(projection=name, n=n, k=k, rows=m, kind="triton gemv (weight-only, shipped)", us=us,
                       gb_per_s=n * k / us / 1e3, fraction_of_copy=n * k / us / 1e3 / copy["gb_per_s"])
            rows.append(row)
            print(f"{name:8s} m={m} {row['kind']:40s} {us:7.2f} us {row['gb_per_s']:6.0f} GB/s", flush=True)
            best = None  # (us, unroll, warps_k) of W8A8
            for mode, want_mode, x_in, scale_in in (("cuda mma W8A8", want, xq, x_scale),
                                                     ("cuda mma weight-only (bf16 x as f16)", want_weight_only, x,
                                                      None)):
                for unroll, warps_k in VARIANTS:
                    if k % (64 * unroll * warps_k):
                        continue
                    y.fill_(float("nan"))
                    cuda_gemv(dll, w0, s0, x_in, scale_in, y, unroll, warps_k)
                    torch.cuda.synchronize()
                    err = ((y.float() - want_mode).norm() / want_mode.norm()).item()
                    if not err < 1e-2:
                        print(f"{name} m={m} {mode} unroll={unroll} warps_k={warps_k}: WRONG, relative error {err}",
                              flush=True)
                        rows.append(dict(projection=name, n=n, k=k, rows=m, kind=mode, unroll=unroll,
                                         warps_k=warps_k, relative_error=err, correct=False))
                        continue

                    def cuda_run(unroll=unroll, warps_k=warps_k, x_in=x_in, scale_in=scale_in, y=y):
                        for w, s in weights:
                            cuda_gemv(dll, w, s, x_in, scale_in, y, unroll, warps_k)

                    us = graph_ms([cuda_run], min_calls=4) * 1e3 / copies
                    row = dict(projection=name, n=n, k=k, rows=m, kind=mode, unroll=unroll, warps_k=warps_k,
                               relative_error=err, correct=True, us=us, gb_per_s=n * k / us / 1e3,
                               fraction_of_copy=n * k / us / 1e3 / copy["gb_per_s"])
                    rows.append(row)
                    print(f"{name:8s} m={m} {mode} unroll={unroll} warps_k={warps_k:<2d} {us:7.2f} us "
                          f"{row['gb_per_s']:6.0f} GB/s", flush=True)
                    if scale_in is not None and (best is None or us < best[0]):
                        best = (us, unroll, warps_k)
            if best is None:
                continue

            # what W8A8 costs where the engine's one-row path has no quantized input yet (o_proj, down_proj):
            # the engine's row quantization kernel before each projection, both PDL launches in one graph
            def quantized_run(unroll=best[1], warps_k=best[2], x=x, y=y):
                for w, s in weights:
                    q, scale = quantize_rows_fp8(x)
                    cuda_gemv(dll, w, s, q, scale.view(-1), y, unroll, warps_k)

            us = graph_ms([quantized_run], min_calls=4) * 1e3 / copies
            rows.append(dict(projection=name, n=n, k=k, rows=m, kind="row quantization + cuda mma W8A8 (best tile)",
                             unroll=best[1], warps_k=best[2], us=us))
            print(f"{name:8s} m={m} row quantization + cuda mma (unroll={best[1]}, warps_k={best[2]})"
                  f"{'':4s} {us:7.2f} us", flush=True)
        weights.clear()
        torch.cuda.empty_cache()
    write_json(args.out, dict(run_info("cuda_gemv_probe"), copy_bandwidth_gb_s=copy["gb_per_s"], rows=rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
