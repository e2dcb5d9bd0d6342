"""Start-to-ready time of the production server, with Triton's compile cache cold and warm.

For each model: the server is started with TRITON_CACHE_DIR pointing at an empty folder
(cold: every kernel compiles), stopped once /health says ready, then started again on the
same folder (warm: a restart of a container whose cache volume survived). Reports the
seconds from launch to "graphserve ready" and the server's own log lines about loading,
graph capture and the warm-up burst.

    python benchmarks/ready_time.py --model llama-3.1-8b --out $OUT
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # live_server
from workload import provenance, resolve_model, write_json  # noqa: E402

PHASES = re.compile(r"loaded|captur|warm|ready|compil", re.IGNORECASE)


def start_to_ready(model: str | None, config: str, cache_dir: Path, timeout: float) -> dict:
    from live_server import ServerProcess

    args = ["--config", config, *(["--model", model] if model else [])]
    started = time.perf_counter()
    server = ServerProcess(args, env={"TRITON_CACHE_DIR": str(cache_dir)})
    try:
        server.wait_ready(timeout=timeout)
        ready_s = time.perf_counter() - started
    finally:
        server.stop()
    return dict(ready_s=round(ready_s, 2), command=shlex.join(server.process.args),
                log=[line.rstrip() for line in server.lines if PHASES.search(line)][-12:],
                cache_files=sum(1 for _ in cache_dir.rglob("*") if _.is_file()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="a random_models config name, a folder, or default")
    parser.add_argument("--config", default="gpu-h200")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--out", type=Path, default=Path("gpu-out"))
    parser.add_argument("--name", default=None)
    args = parser.parse_args()
    model = resolve_model(args.model)
    report = dict(**provenance("ready_time"), model=args.model, model_path=model, config=args.config)
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        for arm in ("cold", "warm"):  # the JSON is written after each: a run cut short keeps the first
            report[arm] = start_to_ready(model, args.config, Path(cache), args.timeout)
            print(f"{args.model}: ready in {report[arm]['ready_s']:.1f} s with a {arm} Triton cache", flush=True)
            write_json(args.out / f"{args.name or 'ready_time-' + args.model}.json", report)


if __name__ == "__main__":
    main()
