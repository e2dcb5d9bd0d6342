"""Gemma 3's text model (Gemma3ForCausalLM, and the text tower of Gemma3ForConditionalGeneration
checkpoints): what its config.json says, read as transformers 5 reads it (Gemma3TextConfig's defaults
for the fields a multimodal config's text_config leaves out), and UnsupportedModelError naming any field
whose value means math graphserve does not do. The decoder itself is llama.py's, with Gemma's layer
(GemmaDecoderLayer: norms after attention and after the MLP, GeGLU) and its embedding scale, two rotary
tables (local layers: rope_local_base_freq) and the final logit softcap."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from graphserve.engine.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")

# Gemma3TextConfig's defaults (transformers 5) for the fields read here
_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=131_072, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096,
                      final_logit_softcapping=None, attn_logit_softcapping=None, use_bidirectional_attention=False,
                      rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, bos_token_id=2, eos_token_id=1)


@dataclass(frozen=True)
class GemmaArgs:
    query_pre_attn_scalar: float  # attention scale: its -1/2 power
    local_rope_theta: float  # the sliding layers' rotary base
    final_logit_softcapping: float | None  # logits = cap * tanh(logits / cap)


def gemma3_text_config(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The text model's config: a Gemma3ForConditionalGeneration's text_config (the vision tower is not
    served: a chat request with an image part is refused by the API), with Gemma3TextConfig's defaults."""
    if arch == "Gemma3ForConditionalGeneration":
        text = dict(cfg.get("text_config") or {})
        for field in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "quantization_config"):
            if field in cfg and field not in text:
                text[field] = cfg[field]
        logger.info("Gemma3ForConditionalGeneration: serving its text tower only; vision_config's tower is not "
                    "loaded (image inputs are refused)")
        cfg = text
    out = {**_TEXT_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None or k.endswith("softcapping")}}
    _refuse(out, arch)
    return out


def _refuse(cfg: dict[str, Any], arch: str) -> None:
    def refuse(field: str, why: str) -> None:
        raise UnsupportedModelError(f"{arch}: unsupported config {field}={cfg.get(field)!r}: {why}")

    if cfg.get("hidden_activation") != "gelu_pytorch_tanh":
        refuse("hidden_activation", "Gemma 3's MLP is GeGLU with gelu_pytorch_tanh")
    if cfg.get("attn_logit_softcapping") is not None:
        refuse("attn_logit_softcapping", "attention logit softcapping is not implemented")
    if cfg.get("use_bidirectional_attention"):
        refuse("use_bidirectional_attention", "graphserve serves causal decoders")
    if cfg.get("attention_bias"):
        refuse("attention_bias", "Gemma 3's attention projections have no bias here")


def gemma3_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global rope_theta, the global layers' rope scaling or None, the local layers' rope_theta), from
    transformers 5's per-layer-type rope_parameters or the older rope_theta / rope_scaling /
    rope_local_base_freq fields. The local layers' rotary has no scaling."""
    params = cfg.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    theta = float(full.get("rope_theta", cfg["rope_theta"]))
    local_theta = float(local.get("rope_theta", cfg["rope_local_base_freq"]))
    scaling = full if full.get("rope_type", "default") != "default" else cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"Gemma3: unsupported config rope_parameters.sliding_attention={local!r}: the "
                                    "local layers' rotary is the default one")
    return theta, scaling, local_theta


def gemma_args(cfg: dict[str, Any]) -> GemmaArgs:
    return GemmaArgs(float(cfg["query_pre_attn_scalar"]), gemma3_rope(cfg)[2], cfg.get("final_logit_softcapping"))


def checkpoint_name(name: str) -> str | None:
    """A checkpoint tensor's name as a Gemma3ForCausalLM's (the text tower of a multimodal checkpoint,
    under language_model.), or None for the vision tower's and the projector's (not loaded)."""
    for prefix, to in (("language_model.model.", "model."), ("model.language_model.", "model."),
                       ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return to + name[len(prefix):]
    if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                        "model.multi_modal_projector.")):
        return None
    return name
