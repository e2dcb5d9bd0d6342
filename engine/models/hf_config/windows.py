"""Sliding-window attention per layer, read from a Hugging Face config as transformers reads it.

A layer with window W lets the query at position p attend to keys p - W < k <= p (the last W
positions, its own included: transformers' masking_utils.sliding_window_overlay); None is full
causal attention. Which layers slide depends on the family:
- Mistral, Mixtral, Qwen3-MoE (with use_sliding_window): `sliding_window`, in every layer;
- Qwen2, Qwen3: `sliding_window` when `use_sliding_window`, in the layers from `max_window_layers`
  on, or in those `layer_types` names "sliding_attention";
- Gemma 3, gpt-oss (and any config with `layer_types`): the layers `layer_types` names
  "sliding_attention" (Gemma 3 without it: every `sliding_window_pattern`-th layer is global).
"""

from __future__ import annotations

from typing import Any

from graphserve.engine.errors import UnsupportedModelError

_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention), or UnsupportedModelError naming the field."""
    window = cfg.get("sliding_window")
    if arch in ("Qwen3MoeForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window"):
        window = None
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise UnsupportedModelError(f"{arch}: unsupported config sliding_window={window!r}: a positive integer or null")
    if arch in _EVERY_LAYER:
        return (window,) * num_layers
    if arch == "LlamaForCausalLM":
        return (None,) * num_layers
    types = cfg.get("layer_types")
    if types is None:
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            first = cfg.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(num_layers)]
        elif arch.startswith("Gemma3"):
            pattern = cfg.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        else:
            types = ["full_attention"] * num_layers
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise UnsupportedModelError(f"{arch}: unsupported config layer_types={types!r}: one of "
                                    f"{', '.join(_LAYER_TYPES)} for each of the {num_layers} layers")
    if "sliding_attention" in types and window is None and arch not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        raise UnsupportedModelError(f"{arch}: unsupported config sliding_window=None with sliding_attention "
                                    "layers in layer_types")
    return tuple(window if t == "sliding_attention" else None for t in types)

