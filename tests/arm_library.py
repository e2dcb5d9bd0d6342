"""A kernel cross-built for ARM (tests/arm_builds.py) standing in for its CLibrary: the engine's
own wrappers (engine/cpu/attention.py, linear.py, ops.py, quant_linear.py) take it as their
`library` and call its functions with pointers into this process's tensors, as they call the ctypes
library. Each call reads the arrays behind those pointers (their sizes from the call's other
arguments, as the C function reads them), runs the ARM build's driver under qemu on them, and
writes what the function wrote back where it points."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import arm_builds

F32, I32 = 4, 4


def _panels(n: int) -> int:
    return -(-n // 16)


def _rows(rows: int, stride: int, width: int) -> int:
    """elements from a strided matrix's first to its last"""
    return (rows - 1) * stride + width


def _kv_bytes(a: SimpleNamespace) -> int:
    """each KV cache's bytes up to the last block a table entry in use names"""
    lens = np.frombuffer(ctypes.string_at(a.lens, I32 * a.B), np.int32)
    tables = np.frombuffer(ctypes.string_at(a.tables, I32 * _table_len(a)), np.int32)
    used = max(int(tables[b * a.bt_s0: b * a.bt_s0 + -(-int(n) // a.bs)].max()) for b, n in enumerate(lens))
    return F32 * (used + 1) * a.bs * a.Hkv * a.D


def _table_len(a: SimpleNamespace) -> int:
    lens = np.frombuffer(ctypes.string_at(a.lens, I32 * a.B), np.int32)
    return max(b * a.bt_s0 + -(-int(n) // a.bs) for b, n in enumerate(lens))


# each function's arguments, in order: a name alone is an int64; "name:f" a float32; "name:p" an
# input array and "name:o" one it writes, each with its size in bytes from the arguments
Size = Callable[[SimpleNamespace], int]
SIGNATURES: dict[str, tuple[str, dict[str, Size]]] = {
    "paged_decode": ("q:p q_s0 q_s1 k:p v:p tables:p bt_s0 lens:p out:o B Hq Hkv D bs scale:f split window sinks:p", {
        "q": lambda a: F32 * ((a.B - 1) * a.q_s0 + _rows(a.Hq, a.q_s1, a.D)),
        "k": _kv_bytes, "v": _kv_bytes,
        "tables": lambda a: I32 * _table_len(a),
        "lens": lambda a: I32 * a.B,
        "out": lambda a: F32 * a.B * a.Hq * a.D,
        "sinks": lambda a: F32 * a.Hq}),
    "pack_panels": ("w:p n k panels:o", {
        "w": lambda a: F32 * a.n * a.k,
        "panels": lambda a: F32 * _panels(a.n) * a.k * 16}),
    "panel_linear": ("x:p rows ldx panels:p n k bias:p out:o ldo", {
        "x": lambda a: F32 * _rows(a.rows, a.ldx, a.k),
        "panels": lambda a: F32 * _panels(a.n) * a.k * 16,
        "bias": lambda a: F32 * a.n,
        "out": lambda a: F32 * _rows(a.rows, a.ldo, a.n)}),
    "add_rms_norm": ("x:p ldx residual:p ldr weight:p eps:f rows hidden out:o ldo res_out:o ldro", {
        "x": lambda a: F32 * _rows(a.rows, a.ldx, a.hidden),
        "residual": lambda a: F32 * _rows(a.rows, a.ldr, a.hidden),
        "weight": lambda a: F32 * a.hidden,
        "out": lambda a: F32 * _rows(a.rows, a.ldo, a.hidden),
        "res_out": lambda a: F32 * _rows(a.rows, a.ldro, a.hidden)}),
    "silu_mul": ("y:p ldy rows inter out:o ldo", {
        "y": lambda a: F32 * _rows(a.rows, a.ldy, 2 * a.inter),
        "out": lambda a: F32 * _rows(a.rows, a.ldo, a.inter)}),
    "quant_linear": ("type x:p rows ldx weight:p n k panel_stride bias:p out:o ldo", {
        "x": lambda a: F32 * _rows(a.rows, a.ldx, a.k),
        "weight": lambda a: _panels(a.n) * a.panel_stride,
        "bias": lambda a: F32 * a.n,
        "out": lambda a: F32 * _rows(a.rows, a.ldo, a.n)}),
    "quantize_rows": ("x:p rows ldx k xq:o dx:o", {
        "x": lambda a: F32 * _rows(a.rows, a.ldx, a.k),
        "xq": lambda a: a.rows * a.k,
        "dx": lambda a: F32 * a.rows * (a.k // 32)}),
}


def _call(path: Path, function: str, *args) -> None:
    names, sizes = SIGNATURES[function]
    fields = [field.partition(":") for field in names.split()]
    assert len(fields) == len(args), f"{function} takes {len(fields)} arguments"
    a = SimpleNamespace(**{name: value for (name, _, _), value in zip(fields, args)})
    stdin, outputs = [], []
    for (name, _, kind), value in zip(fields, args):
        if kind == "f":
            stdin.append(b"f" + struct.pack("<f", value))
        elif not kind:
            stdin.append(b"i" + struct.pack("<q", int(value)))
        elif not value:  # NULL
            stdin.append(kind.encode() + struct.pack("<q", -1))
        else:
            size = sizes[name](a)
            stdin.append(kind.encode() + struct.pack("<q", size) + ctypes.string_at(value, size))
            if kind == "o":
                outputs.append((value, size))
    result = arm_builds.run(path, function, b"".join(stdin))
    assert len(result) == sum(size for _, size in outputs), f"{function}: {len(result)} bytes back"
    offset = 0
    for pointer, size in outputs:
        ctypes.memmove(pointer, result[offset:offset + size], size)
        offset += size


class ArmLibrary:
    """engine/cpu/<kernel>.c as `which` (an arm_builds.Build) builds it, in a CLibrary's place."""

    def __init__(self, kernel: str, which: arm_builds.Build):
        self.kernel, self.which = kernel, which
        self.path = arm_builds.binary(kernel, which)
        self._functions = SimpleNamespace(**{
            name: (lambda *args, _name=name: _call(self.path, _name, *args)) for name in SIGNATURES})
        self._isa, self._threads = arm_builds.run(self.path, "gs_isa").decode().splitlines()

    def get(self) -> SimpleNamespace:
        return self._functions

    def isa(self) -> str:
        return self._isa

    def threads(self) -> str:
        return self._threads
