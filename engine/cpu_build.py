"""Builds the CPU backend's C kernels (engine/cpu_attention.py, engine/cpu_linear.py) with the
system's C compiler on first use, for this machine (-march=native), into ~/.cache/graphserve
(a second or so each), and loads them through ctypes. Their OpenMP threads are torch's own: the
same libgomp runtime, already loaded by torch."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("graphserve.engine")

# fast-math for vectorised expf (glibc's libmvec) and reassociated sums; infinities kept. Compile
# only: linked with -ffast-math, a shared object gets crtfastmath.o, which turns on flush-to-zero
# for the whole process when loaded (denormal request floats then decoded as 0.0 in the core).
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "graphserve" / "cpu_kernels"


class CLibrary:
    """One C source, built once per process on first use. `functions`: name -> (argtypes,
    restype). `disable_env`: an environment variable that, set to "torch", turns the kernel off
    (its callers then take their torch path)."""

    def __init__(self, name: str, source: str, functions: dict[str, tuple[list, object]], disable_env: str):
        self.name, self.source, self.functions, self.disable_env = name, source, functions, disable_env
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed = False

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

    def _build(self) -> ctypes.CDLL | None:
        if os.environ.get(self.disable_env, "").lower() == "torch":
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            logger.info("no C compiler: the CPU kernel %s is replaced by torch", self.name)
            return None
        # the machine's own build (-march=native): keyed by the source, flags and host
        key = hashlib.sha256("\0".join([self.source, *_FLAGS, *_LINK_FLAGS, compiler, os.uname().machine,
                                        os.uname().nodename]).encode()).hexdigest()[:16]
        path = cache_dir() / f"{self.name}-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                src, obj, lib = (Path(tmp) / f"{self.name}.{ext}" for ext in ("c", "o", "so"))
                src.write_text(self.source)
                result = subprocess.run([compiler, *_FLAGS, "-c", str(src), "-o", str(obj)],
                                        capture_output=True, text=True)
                if result.returncode == 0:
                    result = subprocess.run([compiler, *_LINK_FLAGS, str(obj), "-o", str(lib), "-lm"],
                                            capture_output=True, text=True)
                if result.returncode != 0:
                    logger.warning("building the CPU kernel %s failed (torch instead): %s", self.name,
                                   result.stderr[-2000:])
                    return None
                os.replace(lib, path)  # atomic: concurrent builders each install a whole file
        lib = ctypes.CDLL(str(path))  # its libgomp resolves to torch's, loaded with torch already
        for function, (argtypes, restype) in self.functions.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = restype
        return lib
