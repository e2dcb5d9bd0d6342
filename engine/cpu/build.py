"""Builds the CPU backend's C kernels (the .c files beside this module, with their headers) with
the system's C compiler on first use, for this machine's instruction sets, into
~/.cache/graphserve (a second or so each), and loads them through ctypes.

The instruction sets: the machine's own (-march=native; -mcpu=native on ARM), capped by
GRAPHSERVE_CPU_ISA (`generic`, `avx2`, `avx-vnni`, `avx512` on x86; `generic`, `neon`, `dotprod`,
`i8mm` on ARM) to build what a smaller machine would run. A cap never adds what the machine lacks,
so a build never holds an instruction this CPU cannot execute; the cache is keyed by the
compiler's own feature macros for the flags, so a copied cache or image built on another CPU is
never loaded here. Each library says which path it took (`isa()`); the engine logs it at start.

Threads: OpenMP where the compiler has it (the same libgomp runtime as torch's, already loaded,
so torch.set_num_threads governs both), else a small pthreads pool in parallel.h (Apple's
compiler has no -fopenmp), sized by set_num_threads()."""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("graphserve.engine")

SOURCE_DIR = Path(__file__).resolve().parent
ISA_ENV = "GRAPHSERVE_CPU_ISA"

# fast-math for vectorised sums (reassociation); infinities kept. Compile only: linked with
# -ffast-math, a shared object gets crtfastmath.o, which turns on flush-to-zero for the whole
# process when loaded (denormal request floats then decoded as 0.0 in the core).
_COMMON_FLAGS = ["-O3", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-std=gnu11", "-Wall", "-Wextra",
                 "-Wno-unused-parameter", "-Wno-unknown-pragmas"]

# Each cap's flags after the machine's own -march: what a machine with only that set would build.
# x86: -mno-avx512f takes every AVX-512 extension with it, -mno-avx every AVX extension (FMA, F16C).
X86_LEVELS = {
    "generic": ["-mno-avx", "-DGS_GENERIC"],
    "avx2": ["-mno-avx512f", "-mno-avxvnni"],
    "avx-vnni": ["-mno-avx512f"],
    "avx512": [],
}
# ARM: NEON is part of every AArch64 CPU; dotprod (sdot) and i8mm (smmla) are later extensions.
ARM_LEVELS = {
    "generic": ["-DGS_GENERIC"],
    "neon": ["-march=armv8-a"],
    "dotprod": ["-march=armv8.2-a+dotprod"],
    "i8mm": ["-march=armv8.2-a+dotprod+i8mm"],
}


def is_arm(machine: str | None = None) -> bool:
    return (machine or platform.machine()).lower() in ("aarch64", "arm64")


def levels(machine: str | None = None) -> dict[str, list[str]]:
    """The caps GRAPHSERVE_CPU_ISA takes on this kind of machine, smallest first."""
    return ARM_LEVELS if is_arm(machine) else X86_LEVELS


def native_flags(compiler: str | None = None) -> list[str]:
    if is_arm():
        # Apple's clang and gcc both take -mcpu=native on arm64
        return ["-mcpu=native"]
    return ["-march=native"]


def cap_flags(isa: str | None, machine: str | None = None) -> list[str]:
    """The flags of a cap (None or "native": none). An ARM cap below the machine's own replaces
    -mcpu=native with the cap's -march, which the machine executes (the caps are baselines)."""
    if isa in (None, "", "native"):
        return []
    table = levels(machine)
    if isa not in table:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected native or one of {', '.join(table)}")
    return table[isa]


def target_flags(isa: str | None, machine: str | None = None) -> list[str]:
    """The instruction-set flags of a build at cap `isa`: for this machine (machine None), its own
    -march=native / -mcpu=native, capped; for a cross build (machine "aarch64": the ARM tests),
    the cap's baseline alone, as no machine is there to be native to."""
    target = cap_flags(isa, machine)
    baseline = any(f.startswith("-march=") for f in target)
    if machine is not None:
        if not is_arm(machine) or isa in (None, "", "native"):
            raise ValueError(f"cross builds are for aarch64 at a named cap, not {machine!r} at {isa!r}")
        return target if baseline else [*ARM_LEVELS["neon"], *target]  # generic: AArch64's baseline, plain C
    if is_arm() and baseline:
        return target
    return [*native_flags(), *target]


def thread_flags(openmp: bool) -> list[str]:
    """Compile and link flags for OpenMP, or for parallel.h's pthreads pool."""
    return ["-fopenmp"] if openmp else ["-pthread"]


def compile_flags(isa: str | None, machine: str | None = None, openmp: bool = True) -> list[str]:
    """Every flag a kernel's compile takes, for (cap, machine as target_flags, OpenMP or the pthreads
    pool): the one place that decides them, for the builds here and the ARM tests' cross builds."""
    return [*_COMMON_FLAGS, *target_flags(isa, machine), *thread_flags(openmp)]


def requested_isa() -> str | None:
    return os.environ.get(ISA_ENV) or None


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "graphserve" / "cpu_kernels"


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


@functools.lru_cache(maxsize=None)
def _probe(compiler: str, flags: tuple[str, ...]) -> tuple[str, bool]:
    """(the compiler's predefined macros for these flags: the instruction sets it will use,
    whether it takes -fopenmp)."""
    macros = subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                            text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "omp.c"
        src.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
        openmp = subprocess.run([compiler, "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(Path(tmp) / "omp.so")],
                                capture_output=True).returncode == 0
    return "\n".join(sorted(line for line in macros.splitlines() if "__" in line)), openmp


def _sources() -> str:
    """Every C source and header of the kernels: any change rebuilds every library."""
    return "\0".join(f"{p.name}\0{p.read_text()}" for p in sorted(SOURCE_DIR.glob("*.[ch]")))


class CLibrary:
    """One C file (beside this module), built once per process on first use. `functions`: name ->
    (argtypes, restype). `disable_env`: an environment variable that, set to "torch", turns the
    kernel off (its callers then take their torch path). `isa`: a cap for this library alone
    (tests build each level the machine executes); None follows GRAPHSERVE_CPU_ISA.
    `openmp=False` builds the pthreads pool instead (what a compiler without OpenMP gets)."""

    def __init__(self, name: str, source: str, functions: dict[str, tuple[list, object]], disable_env: str,
                 isa: str | None = None, openmp: bool = True):
        self.name, self.source, self.functions, self.disable_env = name, source, functions, disable_env
        self.isa_cap, self.openmp = isa, openmp
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed = False

    def variant(self, isa: str, openmp: bool = True) -> CLibrary:
        """The same library built with another cap (or without OpenMP)."""
        return CLibrary(self.name, self.source, self.functions, self.disable_env, isa=isa, openmp=openmp)

    def get(self) -> ctypes.CDLL | None:
        """The loaded library, or None where it cannot be built (no compiler, a build error)."""
        if self._lib is None and not self._failed:
            with self._lock:
                if self._lib is None and not self._failed:
                    try:
                        self._lib = self._build()
                    except Exception:  # noqa: BLE001 - any failure means the torch path
                        logger.warning("CPU kernel %s unavailable (torch instead)", self.name, exc_info=True)
                    self._failed = self._lib is None
        return self._lib

    def isa(self) -> str | None:
        """The path this build took ("AVX-512", "AVX2", "NEON dotprod", "generic", ...), or None."""
        lib = self.get()
        return None if lib is None else lib.gs_isa().decode()

    def threads(self) -> str | None:
        lib = self.get()
        return None if lib is None else lib.gs_threading().decode()

    def _build(self) -> ctypes.CDLL | None:
        if os.environ.get(self.disable_env, "").lower() == "torch":
            return None
        compiler = find_compiler()
        if compiler is None:
            logger.info("no C compiler: the CPU kernel %s is replaced by torch", self.name)
            return None
        cap = self.isa_cap if self.isa_cap is not None else requested_isa()
        macros, has_openmp = _probe(compiler, tuple([*_COMMON_FLAGS, *target_flags(cap)]))
        openmp = self.openmp and has_openmp
        flags = compile_flags(cap, openmp=openmp)
        link = ["-shared", *thread_flags(openmp)]
        key = hashlib.sha256("\0".join([_sources(), self.source, *flags, *link, compiler, macros,
                                        platform.machine()]).encode()).hexdigest()[:16]
        path = cache_dir() / f"{self.name}-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            # one builder a library at a time (a server's processes, a test run's workers start together): the
            # others wait for its file instead of compiling the same one
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not path.exists() and not self._compile(compiler, flags, link, path):
                    return None
        lib = ctypes.CDLL(str(path))  # its libgomp resolves to torch's, loaded with torch already
        for function, (argtypes, restype) in {**self.functions, **_COMMON_FUNCTIONS}.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
        if not openmp:
            import torch

            lib.gs_set_num_threads(torch.get_num_threads())
        return lib

    def _compile(self, compiler: str, flags: list[str], link: list[str], path: Path) -> bool:
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            obj, lib = Path(tmp) / f"{self.name}.o", Path(tmp) / f"{self.name}.so"
            result = subprocess.run([compiler, *flags, "-c", str(SOURCE_DIR / self.source), "-o", str(obj)],
                                    capture_output=True, text=True)
            if result.returncode == 0:
                result = subprocess.run([compiler, *link, str(obj), "-o", str(lib), "-lm"],
                                        capture_output=True, text=True)
            if result.returncode != 0:
                logger.warning("building the CPU kernel %s failed (torch instead): %s", self.name,
                               result.stderr[-2000:])
                return False
            os.replace(lib, path)  # atomic: no process ever loads a half-written file
        return True


# every library's: its path and threading (isa.h, parallel.h), the pthreads pool's size
_COMMON_FUNCTIONS = {
    "gs_isa": ([], ctypes.c_char_p),
    "gs_threading": ([], ctypes.c_char_p),
    "gs_set_num_threads": ([ctypes.c_int], None),
}


def executable_levels() -> list[str]:
    """The caps this machine executes, smallest first (ending with its own level): each gives
    another build where the machine has more than the cap."""
    compiler = find_compiler()
    if compiler is None:
        return []
    table = levels()
    if is_arm():
        native, _ = _probe(compiler, tuple(native_flags(compiler)))
        have = ["generic", "neon"]
        if "__ARM_FEATURE_DOTPROD" in native:
            have.append("dotprod")
            if "__ARM_FEATURE_MATMUL_INT8" in native:
                have.append("i8mm")
        return have
    native, _ = _probe(compiler, tuple(native_flags(compiler)))
    have = ["generic"]
    if all(f"__{m}__" in native for m in ("AVX2", "FMA", "F16C")):
        have.append("avx2")
        if "__AVXVNNI__" in native:
            have.append("avx-vnni")
        if all(f"__{m}__" in native for m in ("AVX512F", "AVX512BW", "AVX512VL", "AVX512DQ")):
            have.append("avx512")
    return [level for level in table if level in have]
