"""A decode step's stack of decoder layers in one C call (decoder.c): the same kernels in the same
order as the per-layer Python path, so the same numbers bit for bit, without the Python between
them (per layer about 8 kernel calls and a dozen torch ops, which cost a small model's decode step
more than its kernels at a few rows).

`StackDecoder` holds the layers' weights as the kernels take them; engine/models/cpu_stack.py
builds one from a model where every layer fits (dense, no per-head norms, one rank, float32). Rows with a
LoRA adapter get its product after each projection from engine/cpu/lora.py's kernel (the per-layer
path's too)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from graphserve.engine.cpu import attention, linear, lora, ops, quant_linear
from graphserve.engine.cpu.build import CLibrary

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
MAX_PARTS = 4
PROJECTIONS = 4  # qkv, o, gate_up, down: a layer's LoRA entries, in decoder.c's order


class _Part(ctypes.Structure):
    _fields_ = [("qtype", _i64), ("n", _i64), ("k", _i64), ("stride", _i64), ("weight", _ptr)]


class _Projection(ctypes.Structure):
    _fields_ = [("parts", _i64), ("n", _i64), ("part", _Part * MAX_PARTS), ("bias", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("qkv", _Projection), ("o", _Projection),
                ("gate_up", _Projection), ("down", _Projection), ("k_cache", _ptr), ("v_cache", _ptr),
                ("window", _i64), ("group", _i64)]


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("quant_linear", "panel_linear", "paged_decode", "add_rms_norm", "silu_mul",
                                          "lora_add")]


class _Model(ctypes.Structure):
    _fields_ = [("layers", _i64), ("hidden", _i64), ("heads", _i64), ("kv_heads", _i64), ("head_dim", _i64),
                ("inter", _i64), ("block_size", _i64), ("eps", _f32), ("scale", _f32),
                ("layer", ctypes.POINTER(_Layer)), ("fn", _Kernels)]


LIBRARY = CLibrary("decoder", "decoder.c", {"decode_layers": (
    [ctypes.POINTER(_Model), _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr], None)},
    disable_env="GRAPHSERVE_CPU_DECODER")
# the kernels the stack calls, from their own libraries
_KERNELS = {"quant_linear": quant_linear.LIBRARY, "panel_linear": linear.LIBRARY,
            "paged_decode": attention.LIBRARY, "add_rms_norm": ops.LIBRARY, "silu_mul": ops.LIBRARY}


def available() -> bool:
    return LIBRARY.get() is not None and all(library.get() is not None for library in _KERNELS.values())


def takes_lora() -> bool:
    """Whether the stack takes steps with LoRA adapters (the LoRA kernel built too)."""
    return lora.available()


@dataclass(frozen=True)
class Projection:
    """A projection's output rows in parts, side by side: GGUF-quantized weights (their kernel's
    layout) or float32 panels (linear.pack_panels, with the output width), then the bias."""
    parts: tuple[quant_linear.QuantizedWeight | tuple[torch.Tensor, int], ...]
    bias: torch.Tensor | None

    @property
    def float32_panels(self) -> bool:
        return any(not isinstance(part, quant_linear.QuantizedWeight) for part in self.parts)


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    window: int | None = None  # the layer's sliding window (None: full attention)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    block_size: int
    eps: float
    scale: float


def _projection(p: Projection) -> _Projection:
    out = _Projection(parts=len(p.parts), bias=None if p.bias is None else p.bias.data_ptr())
    width = 0
    for i, part in enumerate(p.parts):
        if isinstance(part, quant_linear.QuantizedWeight):
            out.part[i] = _Part(quant_linear.TYPES[part.qtype], part.n, part.k, part.panels.shape[1],
                                part.panels.data_ptr())
            width += part.n
        else:
            panels, n = part
            out.part[i] = _Part(-1, n, panels.shape[1], 0, panels.data_ptr())
            width += n
    out.n = width
    return out


class StackDecoder:
    """Every layer of a decode step in one call, over the KV caches it is given at its first run."""

    def __init__(self, layers: list[LayerWeights], shape: Shape):
        if not layers or any(len(p.parts) > MAX_PARTS for w in layers for p in (w.qkv, w.o, w.gate_up, w.down)):
            raise ValueError("a stack of 1+ layers whose projections have at most 4 parts")
        self.layers, self.shape = layers, shape
        # rows the float32 panel kernel takes (above: torch's F.linear, which this stack cannot call)
        self.max_rows = linear.MAX_ROWS if any(p.float32_panels for w in layers
                                                for p in (w.qkv, w.o, w.gate_up, w.down)) else None
        self._model: _Model | None = None
        self._built_for: tuple = ()  # the caches' addresses and the layers' groups it was built for
        self._lora: ctypes.Array | None = None  # the LoRA entries' table, [layers * PROJECTIONS] pointers
        self._lora_for: tuple = ()  # the projections it points at (held, so the addresses stay theirs)

    def _build(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: tuple[int, ...]) -> _Model:
        s = self.shape
        table = (_Layer * len(self.layers))()
        for i, (w, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            table[i] = _Layer(w.input_norm.data_ptr(), w.post_norm.data_ptr(), _projection(w.qkv), _projection(w.o),
                              _projection(w.gate_up), _projection(w.down), k_cache.data_ptr(), v_cache.data_ptr(),
                              w.window or 0, layer_groups[i] if layer_groups else 0)
        kernels = _Kernels(**{name: ctypes.cast(getattr(library.get(), name), _ptr).value
                              for name, library in _KERNELS.items()})
        if lora.available():
            kernels.lora_add = ctypes.cast(lora.LIBRARY.get().lora_add, _ptr).value
        model = _Model(len(self.layers), s.hidden, s.heads, s.kv_heads, s.head_dim, s.inter, s.block_size, s.eps,
                       s.scale, table, kernels)
        model._table = table  # kept alive with the struct that points at it
        return model

    def attach_lora(self, projections: tuple[lora.LoraProjection | None, ...]) -> None:
        """The model's LoRA slots, once (lora.projection() per layer for its qkv, o, gate_up and down, None
        where one has none): the runner rewrites the slots' contents in place, never where they are."""
        if len(projections) != len(self.layers) * PROJECTIONS:
            raise ValueError(f"{PROJECTIONS} LoRA entries a layer, got {len(projections)} for {len(self.layers)}")
        self._lora = (_ptr * len(projections))(*(None if p is None else ctypes.addressof(p) for p in projections))
        self._lora_for = projections

    @property
    def lora_attached(self) -> bool:
        return self._lora is not None

    def applies(self, x: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and x.shape[1] == self.shape.hidden
                and (self.max_rows is None or x.shape[0] <= self.max_rows))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: list[torch.Tensor],
            block_tables: list[torch.Tensor], context_lens: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], layer_groups: tuple[int, ...] = (),
            lora_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, hidden] (the embeddings; overwritten) -> (the last layer's output, the residual
        stream), as the layers' forward returns them. cos, sin: [B, head_dim] contiguous (the rows'
        rotary tables); per KV cache group, slots int64 [B] and block_tables int32 [B, W];
        context_lens int32 [B]; layer_groups: each layer's group (empty: all group 0); lora_slots
        int32 [B], each row's LoRA slot (-1: none; None: no row has an adapter), over the slots given
        to attach_lora(). The caller checked applies()."""
        built_for = (tuple(t.data_ptr() for pair in kv_caches for t in pair), layer_groups)
        if self._model is None or built_for != self._built_for:
            self._model, self._built_for = self._build(kv_caches, layer_groups), built_for
        assert context_lens.dtype == torch.int32 and context_lens.is_contiguous()
        assert cos.is_contiguous() and sin.is_contiguous()
        for s, t in zip(slots, block_tables):
            assert s.dtype == torch.int64 and t.dtype == torch.int32 and s.is_contiguous() and t.stride(1) == 1
        groups = len(slots)
        slot_ptrs = (_ptr * groups)(*(s.data_ptr() for s in slots))
        table_ptrs = (_ptr * groups)(*(t.data_ptr() for t in block_tables))
        strides = (_i64 * groups)(*(t.stride(0) for t in block_tables))
        batch = x.shape[0]
        table = None
        if lora_slots is not None:
            assert self._lora is not None, "attach_lora() first"
            assert lora_slots.dtype == torch.int32 and lora_slots.is_contiguous() and lora_slots.shape == (batch,)
            table = self._lora
        residual = torch.empty_like(x)
        LIBRARY.get().decode_layers(ctypes.byref(self._model), batch, x.data_ptr(), residual.data_ptr(),
                                    cos.data_ptr(), sin.data_ptr(), slot_ptrs, table_ptrs, strides,
                                    context_lens.data_ptr(), int(batch < 2 * torch.get_num_threads()), table,
                                    None if table is None else lora_slots.data_ptr())
        return x, residual
