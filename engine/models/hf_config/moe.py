"""The mixture-of-experts part of a Hugging Face config (Qwen3-MoE, Mixtral): MoeArgs, and a clear
UnsupportedModelError for any field whose value changes the math in a way graphserve does not
implement. What the MoE layer can serve (the CPU, CPU ranks, or one CUDA GPU -- sharding.check_tensor_parallel
refuses CUDA ranks --, FP8 experts but no other quantization) is checked at load by check_moe_servable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphserve.engine.errors import InvalidConfigError, UnsupportedModelError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")

# Config fields of other MoE families (Qwen2-MoE, DeepSeek, ...) whose presence with a value other
# than the one given here means math this layer does not do: shared experts, grouped or biased
# routing, scaled routing weights, dense layers mixed in.
_MUST_EQUAL = {
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "scoring_func": (None, "softmax"),
    "routed_scaling_factor": (None, 1, 1.0),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
    "n_group": (None, 1),
    "topk_group": (None, 1),
}


@dataclass(frozen=True)
class MoeArgs:
    num_experts: int
    top_k: int  # experts each token goes to
    expert_intermediate_size: int  # each expert's SwiGLU width
    renormalize: bool  # the top-k probabilities scaled to sum to 1 (Mixtral always; Qwen3-MoE: norm_topk_prob)


def parse_moe(cfg: dict[str, Any], arch: str) -> MoeArgs | None:
    """MoeArgs for an MoE architecture (None for a dense one), or UnsupportedModelError naming the
    config field graphserve does not implement."""
    if arch not in MOE_ARCHITECTURES:
        return None
    _refuse_unsupported_fields(cfg, arch)
    if arch == "Qwen3MoeForCausalLM":
        # config.json says num_experts; transformers 5's save_pretrained writes its alias num_local_experts
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        moe = MoeArgs(num_experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                      bool(cfg.get("norm_topk_prob", False)))
    else:
        moe = MoeArgs(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True)
    if not 1 <= moe.top_k <= moe.num_experts:
        raise UnsupportedModelError(f"{arch}: num_experts_per_tok {moe.top_k} must be between 1 and the "
                                    f"{moe.num_experts} experts")
    return moe


def _refuse_unsupported_fields(cfg: dict[str, Any], arch: str) -> None:
    def refuse(field: str, why: str) -> None:
        raise UnsupportedModelError(f"{arch}: unsupported config {field}={cfg.get(field)!r}: {why}")

    if cfg.get("decoder_sparse_step", 1) != 1:
        refuse("decoder_sparse_step", "graphserve runs experts in every layer (decoder_sparse_step 1)")
    if cfg.get("mlp_only_layers"):
        refuse("mlp_only_layers", "graphserve runs experts in every layer, none dense")
    if cfg.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "the experts are SwiGLU (silu)")
    if arch == "Qwen3MoeForCausalLM" and cfg.get("attention_bias", False):  # Mixtral's attention has none
        refuse("attention_bias", "the attention projections of MoE models have no bias here")
    for field, allowed in _MUST_EQUAL.items():
        if cfg.get(field) not in allowed:
            refuse(field, "shared experts and other routing schemes than softmax top-k are not implemented")


def check_moe_servable(arch: str, moe: MoeArgs | None, checkpoint_quantization: str | None,
                       device: torch.device, quantization: str | None) -> None:
    """A clear error, before any weight is read, for what the torch MoE layer cannot serve yet."""
    if moe is None:
        return
    if device.type not in ("cpu", "cuda"):
        raise UnsupportedModelError(f"{arch} is a mixture-of-experts model: MoE models are served on the CPU "
                                    f"backend or one CUDA GPU only for now, not on {device.type}")
    if arch == "GptOssForCausalLM":  # its experts as released (MXFP4) or bf16; no quantization of our own
        if quantization is not None:
            raise InvalidConfigError(f"--quantization {quantization} is not supported for {arch}: its experts are "
                                     "served as the checkpoint stores them (MXFP4 or bf16)")
        return
    if checkpoint_quantization not in (None, "fp8"):
        raise UnsupportedModelError(f"{arch}: quantized ({checkpoint_quantization}) mixture-of-experts "
                                    "checkpoints are not supported (FP8 ones are)")
    if quantization not in (None, "fp8"):
        raise InvalidConfigError(f"--quantization {quantization} is not supported for mixture-of-experts models "
                                 f"({arch}): fp8 is")
