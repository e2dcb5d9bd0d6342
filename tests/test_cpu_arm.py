"""The CPU kernels' ARM64 builds, cross-compiled and run under qemu (tests/arm_builds.py): each
level (generic; NEON; dotprod; i8mm) and the pthreads pool, through the engine's own wrappers
(tests/arm_library.py), against the references of the x86 builds' tests (tests/cpu_references.py,
quant_references.py), at small real shapes (SmolLM2-135M's hidden 576, 9 / 3 heads of 64; a
head_dim of 128; ragged ones; N not a multiple of 16; 1, 5 and 17 rows). Each build reports the
path its level implies, and the pthreads one links no OpenMP runtime. Correctness only: qemu says
nothing of speed."""

from __future__ import annotations

import functools
import subprocess

import pytest
import torch
import torch.nn.functional as F

import arm_builds
from arm_builds import BUILDS, KERNELS, Build
from arm_library import ArmLibrary
from cpu_references import assert_matches_float64_product, attention_reference

from graphserve.engine.cpu import attention as cpu_attention
from graphserve.engine.cpu import linear as cpu_linear
from graphserve.engine.cpu import ops as cpu_ops

BUILD_PARAMS = [pytest.param(which, id=which.id) for which in BUILDS]
# the path each kernel reports at each level: quant_linear's integer products take dotprod and i8mm
PATHS = {"generic": "generic", "neon": "NEON", "dotprod": "NEON", "i8mm": "NEON"}
QUANT_PATHS = {**PATHS, "dotprod": "NEON dotprod", "i8mm": "NEON i8mm"}


@pytest.fixture(scope="module")
def built() -> None:
    """Every build, compiled side by side (or found in the cache) before the first test."""
    arm_builds.require_tools()
    arm_builds.build_all()


@functools.cache
def arm(kernel: str, which: Build) -> ArmLibrary:
    return ArmLibrary(kernel, which)


def test_missing_tools_skip_the_tests_unless_they_are_required(monkeypatch):
    """A user without the cross tools is told which package to install; CI (the variable set)
    cannot pass without running these tests."""
    monkeypatch.setattr(arm_builds.shutil, "which", lambda tool: None)
    monkeypatch.delenv(arm_builds.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="gcc-aarch64-linux-gnu"):
        arm_builds.require_tools()
    monkeypatch.setenv(arm_builds.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=arm_builds.REQUIRE_ENV):
        arm_builds.require_tools()


@pytest.mark.parametrize("which", BUILD_PARAMS)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_each_build_takes_the_path_of_its_level(built, kernel, which):
    library = arm(kernel, which)
    assert library.isa() == (QUANT_PATHS if kernel == "quant_linear" else PATHS)[which.level]
    assert library.threads() == ("OpenMP" if which.openmp else "pthreads")


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_the_pthreads_build_has_no_openmp(built, kernel):
    """Linked without -fopenmp it holds no OpenMP runtime (what a compiler without OpenMP needs),
    where an OpenMP build of the same kernel holds libgomp's."""
    def symbols(which: Build) -> str:
        return subprocess.run(["aarch64-linux-gnu-nm", str(arm_builds.binary(kernel, which))], capture_output=True,
                              text=True, check=True).stdout

    pthreads = next(which for which in BUILDS if not which.openmp)
    assert "GOMP_parallel" in symbols(Build(pthreads.level))
    assert "GOMP_" not in symbols(pthreads) and "omp_get" not in symbols(pthreads)


@pytest.mark.parametrize("kv_heads,heads,dim", [pytest.param(3, 9, 64, id="smollm2"), pytest.param(2, 4, 128, id="d128"),
                                                pytest.param(1, 3, 36, id="d36"), pytest.param(1, 2, 30, id="d30")])
@pytest.mark.parametrize("which", BUILD_PARAMS)
def test_attention(built, which, kv_heads, heads, dim):
    """Both task splits (1 row: a task per KV head; 5: per sequence), whole blocks and a tail, windows, sinks, a
    head_dim the NEON path takes in 4-lane steps (36) and one it leaves to plain C (30)."""
    library = arm("attention", which)
    gen = torch.Generator().manual_seed(dim)
    k_cache = torch.randn(40, 16, kv_heads, dim, generator=gen)
    v_cache = torch.randn(40, 16, kv_heads, dim, generator=gen)
    for batch in (1, 5):
        lens = torch.randint(1, 80, (batch,), generator=gen, dtype=torch.int32)
        lens[-1] = 16 * 3 + 5
        width = -(-int(lens.max()) // 16)
        tables = (torch.randperm(39, generator=gen)[:batch * width] + 1).view(batch, width).int()
        q = torch.randn(batch, heads + 2 * kv_heads, dim, generator=gen)[:, :heads]  # strided, as the qkv slice
        q[0, 0] *= 40  # a peaked softmax
        sinks = torch.randn(heads, generator=torch.Generator().manual_seed(batch)) * 2
        sinks[-1] = 60.0  # its head's output near 0
        # a sliding window: the last tokens only; gpt-oss's sinks: a term of each head's denominator
        for window, with_sinks in ((None, False), (7, False), (21, False), (None, True), (7, True)):
            head_sinks = sinks if with_sinks else None
            out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim ** -0.5, library,
                                                       window=window, sinks=head_sinks)
            torch.testing.assert_close(out, attention_reference(q, k_cache, v_cache, tables, lens, dim ** -0.5,
                                                                window=window, sinks=head_sinks), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,with_bias", [(100, 576, True), (37, 33, False)])
@pytest.mark.parametrize("which", BUILD_PARAMS)
def test_linear(built, which, n, k, with_bias):
    library = arm("linear", which)
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    panels = cpu_linear.pack_panels(weight, library)
    for rows in (1, 5, 17):
        x = torch.randn(rows, k, generator=gen)
        assert_matches_float64_product(cpu_linear.panel_linear(x, panels, n, bias, library), x, weight, bias)


@pytest.mark.parametrize("which", BUILD_PARAMS)
def test_rms_norm(built, which):
    library = arm("ops", which)
    gen = torch.Generator().manual_seed(576)
    weight = torch.randn(576, generator=gen)
    for rows, with_residual in ((1, True), (5, False), (17, True)):
        x = (torch.randn(rows, 584, generator=gen) * 3)[:, 4:580]  # strided rows
        residual = torch.randn(rows, 576, generator=gen) if with_residual else None
        out, new_residual = cpu_ops.add_rms_norm(x, residual, weight, 1e-6, library)
        h = x + residual if with_residual else x
        torch.testing.assert_close(new_residual, h, rtol=0, atol=0)
        torch.testing.assert_close(out, F.rms_norm(h, (576,), weight, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("which", BUILD_PARAMS)
def test_silu_mul(built, which):
    library = arm("ops", which)
    gen = torch.Generator().manual_seed(1536)
    for rows, inter in ((1, 1536), (5, 37), (17, 1536)):
        y = torch.randn(rows, 2 * inter, generator=gen) * 6
        y[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's extremes
        gate, up = y.chunk(2, dim=-1)
        out = cpu_ops.silu_mul(y, library)
        torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype,n,k", [("Q8_0", 37, 96), ("Q4_0", 50, 64), ("Q4_1", 33, 576), ("Q4_K", 21, 256),
                                       ("Q6_K", 40, 512)])
@pytest.mark.parametrize("which", BUILD_PARAMS)
def test_quant_linear(built, which, qtype, n, k):
    """gguf-py's dequantization times the build's own quantized activations (which equal the x86
    build's), and the x86 build's result, to float32 rounding: the same exact int32 block sums and
    float steps; 17 rows take i8mm's row pairs and its odd row."""
    pytest.importorskip("gguf", reason="gguf (gguf-py) makes and reads the quantized weights")
    from quant_references import case, check_against_quantized_activations

    from graphserve.engine.cpu import quant_linear as ql

    if not ql.available():
        pytest.skip("no C compiler here: this machine's build packs the weights and is the comparison")
    library = arm("quant_linear", which)
    for rows in (1, 5, 17):
        raw, x, bias = case(qtype, n, k, rows, True)
        weight = ql.pack_quantized(raw, qtype, n, k)
        out = ql.quant_linear(x, weight, bias, library=library)
        check_against_quantized_activations(out, raw, qtype, x, bias, library)
        assert torch.equal(ql.quantize_activations(x, library)[0], ql.quantize_activations(x)[0])
        torch.testing.assert_close(out, ql.quant_linear(x, weight, bias), rtol=1e-5, atol=1e-5)
