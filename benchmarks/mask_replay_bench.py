"""GPU time of one decode-step graph replay, plain vs masked (grammar bitmask applied before
sampling), per batch bucket: what a grammar row's round costs the device, apart from the host.

    python benchmarks/mask_replay_bench.py --model qwen2.5-0.5b --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workload import provenance, resolve_model, write_json  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--buckets", default="1,8,64")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from graphserve import LLM

    llm = LLM(resolve_model(args.model), device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=1024)
    graphs = llm.engine.core.graphs
    rows = []
    for bucket in map(int, args.buckets.split(",")):
        for variant in ("greedy", "greedy_masked", "sample", "sample_masked"):
            graph = graphs.graphs[(bucket, variant)].graph
            for _ in range(10):
                graphs.step.zero_()  # each replay is step 0 of a round (the step index advances)
                graph.replay()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.replays):
                graphs.step.zero_()
                graph.replay()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - start) / args.replays * 1e3
            rows.append(dict(bucket=bucket, variant=variant, ms_per_replay=ms))
            print(f"{args.model} bucket {bucket:3d} {variant:14s} {ms:.3f} ms/replay", flush=True)
    if args.out:
        write_json(Path(args.out) / f"mask_replay-{args.model}.json",
                   dict(**provenance("mask_replay_bench"), model=args.model, rows=rows))


if __name__ == "__main__":
    main()
