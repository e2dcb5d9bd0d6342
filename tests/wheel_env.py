"""graphserve's wheel, built and installed into a fresh virtual environment for tests/test_wheel.py.

That takes about 40 s of pip on two cores, so conftest starts it in a background process as soon as
a run that selects test_wheel.py has been collected, and the tests wait for it when they get there
(`ready()`); the other tests run beside it meanwhile. Under pytest-xdist (`make test` runs two
workers) the controller process builds it once, in the folder it names in WHEEL_ENV_DIR before the
workers start; the worker that runs test_wheel.py waits for the build's status file there.

    python tests/wheel_env.py OUT   # OUT/wheel/graphserve-*.whl and OUT/venv, then OUT/status
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_ENV_DIR = "GRAPHSERVE_TEST_WHEEL_ENV"  # the run's folder, set by the controller for its workers
_build: subprocess.Popen | None = None


def build(out: Path) -> None:
    wheel_dir, venv = out / "wheel", out / "venv"
    wheel_dir.mkdir(parents=True, exist_ok=True)
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


def claim() -> None:
    """Names the run's folder (the controller, or a run without workers; before any worker starts).
    Made only when a build starts, so a run that never builds (or is killed) leaves nothing behind."""
    os.environ[WHEEL_ENV_DIR] = str(Path(tempfile.gettempdir()) / f"graphserve-wheel-{uuid.uuid4().hex[:12]}")


def _folder() -> Path:
    if WHEEL_ENV_DIR not in os.environ:
        claim()
    return Path(os.environ[WHEEL_ENV_DIR])


def start() -> None:
    """Begins the build in a background process (once a run)."""
    global _build
    out = _folder()
    if _build is None and not (out / "started").exists():
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
        (out / "started").touch()
        log = open(out / "build.log", "wb")
        _build = subprocess.Popen([sys.executable, __file__, str(out)], stdout=log, stderr=subprocess.STDOUT)
        log.close()


def ready() -> tuple[Path, str]:
    """(the wheel, the venv's python), once the build has finished; starts it if nothing did."""
    start()
    out = _folder()
    deadline = time.monotonic() + 1800
    while not (out / "status").exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    status = (out / "status").read_text() if (out / "status").exists() else "timed out"
    if status != "0":
        raise RuntimeError(f"building the wheel's environment failed ({status}):\n"
                           + (out / "build.log").read_text(errors="replace")[-3000:])
    (wheel,) = (out / "wheel").glob("graphserve-*.whl")
    return wheel, str(out / "venv" / "bin" / "python")


def discard() -> None:
    """Stops a build still running and removes the run's folder (the end of the run, by the process
    that claimed it)."""
    global _build
    if _build is not None and _build.poll() is None:
        _build.kill()
        _build.wait()
    _build = None
    if WHEEL_ENV_DIR in os.environ:
        shutil.rmtree(os.environ.pop(WHEEL_ENV_DIR), ignore_errors=True)


def _main(out: Path) -> None:
    try:
        build(out)
        status = "0"
    except Exception as exc:  # noqa: BLE001 -- reported to the waiting test through the status file
        print(f"{type(exc).__name__}: {exc}", flush=True)
        status = type(exc).__name__
    (out / "status.tmp").write_text(status)
    os.replace(out / "status.tmp", out / "status")


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
