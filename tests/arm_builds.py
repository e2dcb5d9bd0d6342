"""The CPU kernels cross-built for ARM64 and run under qemu user mode, for tests/test_cpu_arm.py:
each kernel (engine/cpu/<kernel>.c) at each ARM level of GRAPHSERVE_CPU_ISA and once on the
pthreads pool, with build.py's own flags (build.compile_flags) and -Werror, statically linked with
tests/arm/driver.c by aarch64-linux-gnu-gcc, run by `qemu-aarch64 -cpu max` (which has dotprod and
i8mm); both from Debian's packages (gcc-aarch64-linux-gnu, qemu-user: `make arm-tools`). Each
binary is built once per (sources, flags, compiler) into a folder under the temp dir.

Without the tools the tests skip, saying which is missing, unless GRAPHSERVE_REQUIRE_ARM_TESTS=1
(CI's .ci/run): then they fail."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from graphserve.engine.cpu import build

COMPILER, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
TOOLS_PACKAGES = {COMPILER: "gcc-aarch64-linux-gnu", QEMU: "qemu-user"}
REQUIRE_ENV = "GRAPHSERVE_REQUIRE_ARM_TESTS"
DRIVER = Path(__file__).resolve().parent / "arm" / "driver.c"
KERNELS = {"attention": "attention.c", "linear": "linear.c", "ops": "ops.c", "quant_linear": "quant_linear.c"}
MACHINE = "aarch64"


@dataclass(frozen=True)
class Build:
    level: str  # a GRAPHSERVE_CPU_ISA cap on ARM
    openmp: bool = True

    @property
    def id(self) -> str:
        return self.level if self.openmp else f"{self.level}-pthreads"

    def flags(self) -> list[str]:
        return [*build.compile_flags(self.level, MACHINE, self.openmp), "-Werror"]


# every ARM level, then the top one on the pthreads pool (what Apple's compiler, without OpenMP, builds)
BUILDS = [Build(level) for level in build.levels(MACHINE)] + [Build(list(build.levels(MACHINE))[-1], openmp=False)]


def missing_tools() -> str | None:
    """Why the ARM builds cannot run here, or None."""
    missing = [f"{tool} (Debian: {package})" for tool, package in TOOLS_PACKAGES.items() if shutil.which(tool) is None]
    if missing:
        return f"no {' or '.join(missing)}: `make arm-tools` installs them as root"
    return None


def require_tools() -> None:
    """Skips the calling test where the tools are missing; fails it instead under REQUIRE_ENV=1."""
    reason = missing_tools()
    if reason is None:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: the ARM kernel tests must run)")
    pytest.skip(reason)


def cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "graphserve-arm-builds"


@functools.cache
def _compiler_version() -> str:
    return subprocess.run([COMPILER, "--version"], capture_output=True, text=True, check=True).stdout


def _key(kernel: str, flags: list[str], link: list[str]) -> str:
    sources = sorted(build.SOURCE_DIR.glob("*.[ch]")) + [DRIVER]
    text = "\0".join([*(f"{p.name}\0{p.read_text()}" for p in sources), kernel, *flags, *link, _compiler_version()])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# builds that failed in this process, with their compiler's message: not tried again
_failed: dict[Path, str] = {}


def binary(kernel: str, which: Build) -> Path:
    """The driver linked with `kernel` (a KERNELS key) as `which` builds it: from the cache, else
    compiled now (a compile error or warning fails the caller, the compiler's message in the
    exception)."""
    flags = which.flags()
    link = ["-static", *build.thread_flags(which.openmp), "-lm"]
    path = cache_dir() / f"{kernel}-{which.id}-{_key(kernel, flags, link)}"
    if path in _failed:
        raise RuntimeError(_failed[path])
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        result = subprocess.run([COMPILER, *flags, str(DRIVER), str(build.SOURCE_DIR / KERNELS[kernel]), *link,
                                 "-o", str(out)], capture_output=True, text=True)
        if result.returncode != 0:
            _failed[path] = f"cross build of {kernel} ({which.id}) failed:\n{result.stderr[-4000:]}"
            raise RuntimeError(_failed[path])
        os.replace(out, path)  # atomic: a concurrent builder installs a whole file too
    return path


def build_all() -> None:
    """Every kernel in every build, side by side on this machine's cores (a first run's ~1 min of
    CPU time, mostly quant_linear.c's 80 unrolled blocks a level). A build that fails fails the
    tests of its kernel and build only, when they ask for it."""
    jobs = [(kernel, which) for which in BUILDS for kernel in KERNELS]
    # quant_linear.c's builds are the long ones: first, so that the others fill in beside them
    jobs.sort(key=lambda job: job[0] != "quant_linear")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for done in [pool.submit(binary, kernel, which) for kernel, which in jobs]:
            try:
                done.result()
            except RuntimeError:
                pass


def run(path: Path, function: str, stdin: bytes = b"", threads: int = 3) -> bytes:
    """`path`'s driver calling `function` under qemu (arguments on stdin, outputs from stdout);
    `threads`: OpenMP's, or the pthreads pool's (3: shares are uneven)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run([QEMU, "-cpu", "max", str(path), function], input=stdin, capture_output=True, env=env,
                            timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"{path.name} {function}: exit {result.returncode}: {result.stderr.decode()[-2000:]}")
    return result.stdout
