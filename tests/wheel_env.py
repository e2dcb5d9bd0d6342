"""graphserve's wheel, built and installed into a fresh virtual environment for tests/test_wheel.py.

That takes about 40 s of pip on two cores, so conftest starts it in a background process as soon as
a run that selects test_wheel.py has been collected, and the tests wait for it when they get there
(`ready()`); the other tests run beside it meanwhile.

    python tests/wheel_env.py OUT   # OUT/wheel/graphserve-*.whl and OUT/venv
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_build: tuple[subprocess.Popen, Path] | None = None


def build(out: Path) -> None:
    wheel_dir, venv = out / "wheel", out / "venv"
    wheel_dir.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheel_dir), str(ROOT)], check=True, cwd=wheel_dir, timeout=300)
    (wheel,) = wheel_dir.glob("graphserve-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # --no-compile: byte-compiling all of torch would triple the time; what runs compiles as it imports
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    torch_spec = os.environ.get("TORCH_SPEC", "torch==2.13.0")  # the Makefile's CPU pin
    subprocess.run([*pip, torch_spec], check=True, timeout=900)
    # transformers and kernels unpinned: the newest releases the index has
    subprocess.run([*pip, str(wheel), "transformers", "kernels"], check=True, timeout=900)


def start() -> None:
    """Begins the build in a background process (once a run)."""
    global _build
    if _build is None:
        out = Path(tempfile.mkdtemp(prefix="graphserve-wheel-"))
        log = open(out / "build.log", "wb")
        _build = (subprocess.Popen([sys.executable, __file__, str(out / "env")], stdout=log, stderr=subprocess.STDOUT),
                  out)
        log.close()


def ready() -> tuple[Path, str]:
    """(the wheel, the venv's python), once the build has finished; starts it if nothing did."""
    start()
    process, out = _build
    if process.wait(timeout=1800) != 0:
        raise RuntimeError("building the wheel's environment failed:\n"
                           + (out / "build.log").read_text(errors="replace")[-3000:])
    (wheel,) = (out / "env" / "wheel").glob("graphserve-*.whl")
    return wheel, str(out / "env" / "venv" / "bin" / "python")


def discard() -> None:
    """Stops a build still running and removes its folder (the end of the run)."""
    global _build
    if _build is not None:
        process, out = _build
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(out, ignore_errors=True)
        _build = None


if __name__ == "__main__":
    build(Path(sys.argv[1]))
