"""One closed-loop level of benchmarks/serving.py, run in a process of its own against a server it launches or a
URL: the building block of the A/B drivers (ray_serving.py overhead, lora.py --served)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Load:
    """The client side of a level: serving.py's --model (its vocabulary), streams, request set and client
    processes."""
    model: str
    streams: int
    requests: int
    min_len: int
    max_len: int
    client_procs: int


def serving_level(load: Load, name: str, timeout: float, url: str | None = None, config: str | None = None,
                  server_args: list[str] | None = None, request_models: list[str] | None = None) -> dict:
    """serving.py at `load.streams` against `url`, or against a `graphserve serve --config config server_args...`
    it launches; the level's figures (its JSON goes to a scratch folder, removed here)."""
    scratch = tempfile.mkdtemp(prefix=f"{name}-")
    command = [sys.executable, str(BENCH / "serving.py"), "--model", load.model, "--concurrency", str(load.streams),
               "--num-requests", str(load.requests), "--min-requests", str(load.requests),
               "--min-len", str(load.min_len), "--max-len", str(load.max_len), "--client-procs", str(load.client_procs),
               "--poisson-fraction", "0", "--out", scratch, "--name", name]
    if request_models:
        command += ["--request-models", *request_models]
    command += ["--url", url] if url else ["--config", config or "default", "--", *(server_args or [])]
    try:
        subprocess.run(command, timeout=timeout)
        result = json.loads((Path(scratch) / f"{name}.json").read_text())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    (level,) = [lv for lv in result["levels"] if lv.get("concurrency") == load.streams]
    return level


LEVEL_KEYS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "completed", "errors", "wall_s",
              "client_cpu_fraction_max")


def alternating_rounds(tried: str, run_tried, reference: str, run_reference, rounds: int) -> dict:
    """`rounds` rounds of the two sides in turn (run_*(round) -> a level), so that a shared machine's load swings
    reach both alike: each round's figures, and tried over reference as ratios of the medians and per round."""
    results = []
    for i in range(rounds):
        levels = {tried: run_tried(i), reference: run_reference(i)}
        results.append({side: {k: level.get(k) for k in LEVEL_KEYS} for side, level in levels.items()})
        print(json.dumps(results[-1]), flush=True)

    def median(side: str, key: str) -> float:
        return statistics.median(r[side][key] for r in results)

    return {"rounds": results,
            "tok_s_ratio": median(tried, "output_tok_s") / median(reference, "output_tok_s"),
            "ttft_p50_ratio": median(tried, "ttft_p50_s") / median(reference, "ttft_p50_s"),
            "tok_s_ratio_per_round": [r[tried]["output_tok_s"] / r[reference]["output_tok_s"] for r in results]}
