"""Per-row FP8 activation quantization at decode shapes: one program a row against a program per
chunk of a row (kernels/fp8_quant.py's ROW_CHUNKS path), each timed inside a CUDA graph of
back-to-back calls (as the engine runs it, with PDL between them).

    python benchmarks/fp8_quant_bench.py [--rows 8 64] [--k 4096 14336] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from measure import graph_ms, run_info, write_json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8, 16, 64, 128])
    p.add_argument("--k", type=int, nargs="+", default=[4096, 14336])  # Llama-3.1-8B's o_proj and down_proj inputs
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from graphserve.kernels.launch_settings import sm_count
    from graphserve.kernels.fp8_quant import default_block_k, quantize_rows_fp8

    sms = sm_count(torch.device("cuda"))
    rows_out = []
    for k in args.k:
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = dict(rows=m, k=k, block_k=default_block_k(k),
                       one_program_a_row_us=graph_ms([lambda: quantize_rows_fp8(x, block_k=default_block_k(k))]) * 1e3)
            for chunk in (1024, 2048, 4096):
                if chunk < k:
                    row[f"row_chunk_{chunk}_us"] = graph_ms([lambda c=chunk: quantize_rows_fp8(x, row_chunk=c)]) * 1e3
            best = min((v, name) for name, v in row.items() if name.endswith("_us"))
            row["best"] = best[1]
            rows_out.append(row)
            print(f"M={m:4d} K={k:6d}  " + "  ".join(f"{n[:-3]} {v:6.2f} us" for n, v in row.items() if n.endswith("_us"))
                  + f"  best {best[1][:-3]}", flush=True)
    result = dict(run_info("fp8_quant_bench"), sm_count=sms, rows=rows_out)
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
