"""Builds the CPU backend's C kernels (engine/cpu/attention.py, engine/cpu/linear.py) with the
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


# exp for 16 float lanes, shared by the kernels' sources (inside their #if defined(__AVX512F__))
AVX512_EXP16 = r"""
/* exp(x), 16 lanes: x = n ln2 + r (Cody-Waite, |r| <= ln2 / 2), exp(r) by its Taylor series to r^7
   (truncation < 1e-8 relative), times 2^n by vscalefps (0 for very negative x, as expf). glibc's
   vector expf was not used by the compiler here, and the scalar one made softmax a third of the
   kernel's time. */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
"""


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
