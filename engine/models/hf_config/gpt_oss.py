"""OpenAI's gpt-oss (GptOssForCausalLM): what its config.json says, read as transformers 5 reads it
(GptOssConfig's defaults for the fields a config leaves out), and UnsupportedModelError naming any
field whose value means math graphserve does not do.

The decoder is llama.py's frame with gpt-oss's parts: attention with a learned sink logit per head
(added to each softmax's denominator: the `sinks` of every attention path), q/k/v/o biases, sliding
(128) and full layers alternating (layer_types), YaRN rotary (kernels/rotary.py), and routed experts
with biases and a clamped SwiGLU, their weights bf16 or MXFP4 as stored (engine/models/moe/gpt_oss.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graphserve.engine.errors import UnsupportedModelError
from graphserve.engine.models.hf_config.moe import MoeArgs
from graphserve.kernels.mxfp4 import GROUP

GPT_OSS_ARCHITECTURES = ("GptOssForCausalLM",)

# GptOssConfig's defaults (transformers 5) for the fields read here
_DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201_088, hidden_size=2880,
                 intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                 sliding_window=128, tie_word_embeddings=False, max_position_embeddings=131_072, rms_norm_eps=1e-5,
                 num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True,
                 rope_theta=150_000.0)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


@dataclass(frozen=True)
class GptOssArgs:
    swiglu_alpha: float  # the gate's sigmoid gain: gate * sigmoid(alpha * gate)
    swiglu_limit: float  # gate clamped to at most it, up to [-it, it]


def gpt_oss_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """cfg with GptOssConfig's defaults where it leaves a field out (layer_types: sliding and full
    alternating, from a sliding first layer; the rope: YaRN as gpt-oss ships it), or
    UnsupportedModelError naming the field."""
    out = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    if out.get("layer_types") is None:
        out["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                              for i in range(out["num_hidden_layers"])]
    if "experts_per_token" in cfg and "num_experts_per_tok" not in cfg:  # the original release's name
        out["num_experts_per_tok"] = cfg["experts_per_token"]
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        out["rope_parameters"] = {**_DEFAULT_ROPE, "rope_theta": out["rope_theta"]}
    for field in ("swiglu_alpha", "swiglu_limit"):
        value = out[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UnsupportedModelError(f"GptOssForCausalLM: unsupported config {field}={value!r}: a positive number")
    return out


def gpt_oss_args(cfg: dict[str, Any]) -> GptOssArgs:
    return GptOssArgs(float(cfg["swiglu_alpha"]), float(cfg["swiglu_limit"]))


def gpt_oss_moe(cfg: dict[str, Any]) -> MoeArgs:
    """The experts' shape. gpt-oss routes by a softmax over the top k router logits, which is the softmax
    over all of them renormalized over the top k (MoeArgs.renormalize)."""
    moe = MoeArgs(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True)
    if not 1 <= moe.top_k <= moe.num_experts:
        raise UnsupportedModelError(f"GptOssForCausalLM: unsupported config num_experts_per_tok={moe.top_k!r}: "
                                    f"between 1 and the {moe.num_experts} experts")
    return moe


def checkpoint_quantization(cfg: dict[str, Any]) -> str:
    """"mxfp4" for gpt-oss's own quantization_config (its experts' weights in MXFP4, everything else as
    it is), or UnsupportedModelError naming the field."""
    method = cfg["quantization_config"].get("quant_method")
    if method != "mxfp4":
        raise UnsupportedModelError(f"GptOssForCausalLM: unsupported config quantization_config.quant_method="
                                    f"{method!r}: graphserve loads gpt-oss with MXFP4 experts (as released) or "
                                    "unquantized (bf16) weights")
    for field in ("hidden_size", "intermediate_size"):  # an expert's K: whole groups of 32 values a scale
        if cfg[field] % GROUP:
            raise UnsupportedModelError(f"GptOssForCausalLM: unsupported config {field}={cfg[field]!r} with MXFP4 "
                                        f"experts: a multiple of {GROUP}")
    return "mxfp4"
