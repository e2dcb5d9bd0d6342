"""Which stage of a multi-turn-shaped load makes Triton compile kernels at run time, and what
each stage costs: 32 prompts per stage at the multi-turn benchmark's prompt lengths (100, 328,
... tokens, 128 new each, greedy), through the engine in this process; after each stage, the
kernels that appeared in TRITON_CACHE_DIR. (multiturn_bench.py on 2026-12-02 saw every turn-4
request wait ~0.5 s, with and without prefix caching, where 2026-12-01 saw 70-80 ms.)

    TRITON_CACHE_DIR=/tmp/tc OUT=dir python benchmarks/jit_probe.py --model qwen2.5-0.5b
    TRITON_CACHE_DIR=/tmp/tc python benchmarks/jit_probe.py --device cpu   # a check of the script
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from random_models import random_model  # noqa: E402

from graphserve import LLM, SamplingParams  # noqa: E402


def compiled_kernels(cache: str) -> set[str]:
    return set(glob.glob(os.path.join(cache, "*", "*.json")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", nargs="+", type=int, default=[100, 328, 556, 784, 1012, 1240, 1012])
    args = parser.parse_args()
    cache = os.environ["TRITON_CACHE_DIR"]
    cuda = args.device == "cuda"
    config = (dict(dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192, decode_chunk=8,
                   gpu_memory_utilization=0.5) if cuda else dict(max_model_len=2048))
    llm = LLM(str(random_model(args.model)) if cuda else None, device=args.device, **config)
    rng = random.Random(0)
    seen = compiled_kernels(cache)
    stages = []
    for length in args.lengths:
        prompts = [[rng.randrange(100, 30000) for _ in range(length + rng.randrange(-20, 20))]
                   for _ in range(32 if cuda else 2)]
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=128 if cuda else 4, temperature=0, ignore_eos=True))
        seconds = time.perf_counter() - start
        now = compiled_kernels(cache)
        stages.append(dict(prompt_tokens=length, seconds=seconds, compiled=sorted(Path(p).stem for p in now - seen)))
        seen = now
        print(f"prompts of ~{length} tokens: {seconds:.3f} s, compiled {stages[-1]['compiled']}", flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "jit_probe.json").write_text(json.dumps(dict(model=args.model, device=args.device, stages=stages), indent=1))


if __name__ == "__main__":
    main()
