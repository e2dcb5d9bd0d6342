"""The builds of a CPU kernel (engine/cpu/build.py) that its tests check: one per instruction-set
level this machine executes (GRAPHSERVE_CPU_ISA's caps: what a smaller machine would build), and
the machine's own level on the pthreads pool that a compiler without OpenMP gets (3 threads, so
that shares are uneven)."""

from __future__ import annotations

import pytest

from graphserve.engine.cpu import build

LEVELS = build.executable_levels()
# the path a library reports at each cap, for the kernels whose vector paths need no more than the cap
PATH_AT = {"generic": "generic", "avx2": "AVX2", "neon": "NEON"}


def builds(library: build.CLibrary) -> list:
    """pytest params of `library` built at each level, then on pthreads; ids name them."""
    params = [pytest.param(library.variant(level), id=level) for level in LEVELS]
    if LEVELS:
        params.append(pytest.param(library.variant(LEVELS[-1], openmp=False), id=f"{LEVELS[-1]}-pthreads"))
    return params


def loaded(library: build.CLibrary) -> build.CLibrary:
    """The library built (skipped where this machine has no compiler), its pthreads pool at 3
    threads, and the path it reports the one its cap implies."""
    lib = library.get()
    if lib is None:
        pytest.skip("no C compiler: the kernel is unavailable")
    if library.threads() == "pthreads":
        lib.gs_set_num_threads(3)
    if library.isa_cap in PATH_AT:
        assert library.isa() == PATH_AT[library.isa_cap]
    return library
