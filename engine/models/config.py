"""ModelArgs: the decoder's shape, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphserve.engine.errors import ModelFilesError, UnsupportedModelError
from graphserve.engine.models.hf_config import gpt_oss
from graphserve.engine.models.hf_config.gemma3 import (GEMMA3_ARCHITECTURES, GemmaArgs, gemma3_rope, gemma3_text_config,
                                                       gemma_args)
from graphserve.engine.models.hf_config.gpt_oss import GPT_OSS_ARCHITECTURES, GptOssArgs
from graphserve.engine.models.hf_config.moe import MOE_ARCHITECTURES, MoeArgs, parse_moe
from graphserve.engine.models.hf_config.windows import layer_windows

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",  # Phi-3, Phi-3.5, Phi-4 (fused qkv and gate_up, partial rotary, LongRoPE)
    *GEMMA3_ARCHITECTURES,  # Gemma 3's text model (engine/models/hf_config/gemma3.py)
    *GPT_OSS_ARCHITECTURES,  # gpt-oss, bf16 or MXFP4 experts (engine/models/hf_config/gpt_oss.py); CPU or one CUDA GPU
    *MOE_ARCHITECTURES,  # CPU or one CUDA GPU (hf_config/moe.check_moe_servable)
)


@dataclass
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, gpt-oss
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    dtype: str  # the checkpoint's dtype: float32 | bfloat16 | float16
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    quantization: str | None = None  # the checkpoint's weights: "fp8" (compressed-tensors), None: unquantized
    moe: MoeArgs | None = None  # routed experts in every layer's MLP (Qwen3-MoE, Mixtral); None: dense
    # each layer's sliding attention window (engine/models/hf_config/windows.py), None: full attention; () all full
    layer_windows: tuple[int | None, ...] = ()

    # the dims of each head rotary rotates (Phi-3's partial_rotary_factor); None: all of head_dim
    rotary_dim: int | None = None
    gemma: GemmaArgs | None = None  # Gemma 3: its layer, embedding scale, local rotary, logit softcap
    gpt_oss: GptOssArgs | None = None  # gpt-oss: attention sinks and o bias, its experts (moe/gpt_oss.py)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        if not path.is_dir():
            raise ModelFilesError(f"model folder not found: {path}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelFilesError(f"{path} has no config.json: not a Hugging Face model folder")
        cfg = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_hf_config(cfg, gen)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelArgs":
        archs = cfg.get("architectures") or [cfg.get("model_type", "unknown")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported model architecture {arch!r}; graphserve supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch in GEMMA3_ARCHITECTURES:
            cfg = gemma3_text_config(cfg, arch)
        is_gpt_oss = arch in GPT_OSS_ARCHITECTURES
        if is_gpt_oss:
            cfg = gpt_oss.gpt_oss_config(cfg)
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_scaling = cfg.get("rope_scaling")
        rope_params = cfg.get("rope_parameters")  # transformers 5 moves rope settings here
        rope_theta = cfg.get("rope_theta")
        if rope_params:
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default":
            rope_scaling = None
        if arch in GEMMA3_ARCHITECTURES:
            rope_theta, rope_scaling, _ = gemma3_rope(cfg)
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rotary_dim = None
        if arch == "Phi3ForCausalLM":
            rope_scaling, rotary_dim = _phi3_rope(cfg, rope_scaling, rope_params or {}, head_dim)
        _check_rope_type(arch, rope_scaling)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
            rope_scaling = _yarn_rope(cfg, rope_scaling)
        gen = generation_config or {}
        eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        if is_gpt_oss and cfg.get("quantization_config"):
            quantization = gpt_oss.checkpoint_quantization(cfg)
        else:
            quantization = checkpoint_quantization(cfg.get("quantization_config"))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Mixtral's attention has no bias whatever its config says
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch != "MixtralForCausalLM" and bool(cfg.get("attention_bias"))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", *GEMMA3_ARCHITECTURES),
            dtype=str(dtype).replace("torch.", ""),
            eos_token_ids=eos_ids,
            bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
            quantization=quantization,
            moe=gpt_oss.gpt_oss_moe(cfg) if is_gpt_oss else parse_moe(cfg, arch),
            layer_windows=layer_windows(cfg, arch, cfg["num_hidden_layers"]),
            rotary_dim=rotary_dim,
            gemma=gemma_args(cfg) if arch in GEMMA3_ARCHITECTURES else None,
            gpt_oss=gpt_oss.gpt_oss_args(cfg) if is_gpt_oss else None,
        )


_ROPE_TYPES = ("linear", "llama3")  # and None (default); Phi-3 adds longrope, the others but Gemma 3 yarn


def _check_rope_type(arch: str, rope_scaling: dict[str, Any] | None) -> None:
    kind = None if not rope_scaling else rope_scaling.get("rope_type", rope_scaling.get("type"))
    allowed = _ROPE_TYPES + (("longrope",) if arch == "Phi3ForCausalLM" else
                             () if arch in GEMMA3_ARCHITECTURES else ("yarn",))
    if kind is not None and kind not in allowed:
        raise UnsupportedModelError(f"{arch}: unsupported config rope_scaling type {kind!r}: graphserve implements "
                                    f"{', '.join(allowed)} (or none)")


def _yarn_rope(cfg: dict[str, Any], rope_scaling: dict[str, Any]) -> dict[str, Any]:
    """YaRN's settings with the context lengths its factor may come from, as transformers'
    standardize_rope_params fills them (kernels/rotary.py computes the frequencies)."""
    original = cfg.get("original_max_position_embeddings",
                       rope_scaling.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096)))
    scaling = dict(rope_scaling, rope_type="yarn", original_max_position_embeddings=original,
                   max_position_embeddings=cfg.get("max_position_embeddings", 4096))
    factor = scaling.get("factor")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0):
        raise UnsupportedModelError(f"unsupported config rope_scaling factor={factor!r}: a positive number")
    return scaling


def _phi3_rope(cfg: dict[str, Any], rope_scaling: dict[str, Any] | None, rope_params: dict[str, Any],
               head_dim: int) -> tuple[dict[str, Any] | None, int | None]:
    """Phi-3's rope scaling (su, yarn and longrope are all LongRoPE to transformers) with what its factors
    need, and the rotary dims (partial_rotary_factor); or UnsupportedModelError naming the field."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Phi3ForCausalLM: unsupported config hidden_act={cfg.get('hidden_act')!r}: "
                                    "the MLP is SwiGLU (silu)")
    factor = rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(f"Phi3ForCausalLM: unsupported config partial_rotary_factor={factor!r}: "
                                    f"{head_dim} x it must be an even number of dims")
    if rope_scaling:
        kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if kind in ("su", "yarn", "longrope"):
            rope_scaling = dict(rope_scaling, rope_type="longrope")
            rope_scaling["original_max_position_embeddings"] = cfg.get(
                "original_max_position_embeddings", rope_scaling.get("original_max_position_embeddings",
                                                                      cfg.get("max_position_embeddings", 4096)))
            rope_scaling["max_position_embeddings"] = cfg.get("max_position_embeddings", 4096)
            for field in ("short_factor", "long_factor"):
                values = rope_scaling.get(field)
                if not isinstance(values, list) or len(values) != rotary_dim // 2:
                    raise UnsupportedModelError(f"Phi3ForCausalLM: unsupported config rope_scaling {field}: "
                                                f"a list of {rotary_dim // 2} numbers")
    return rope_scaling, (rotary_dim if rotary_dim < head_dim else None)


def checkpoint_quantization(config: dict[str, Any] | None) -> str | None:
    """"fp8" for compressed-tensors checkpoints with float 8-bit weights and per-channel or
    per-tensor scales (what llm-compressor's FP8 schemes write), None for none; anything else
    is an UnsupportedModelError."""
    if not config:
        return None
    method = config.get("quant_method")
    schemes = [group.get("weights") or {} for group in (config.get("config_groups") or {}).values()]
    if method == "compressed-tensors" and schemes and all(
            w.get("num_bits") == 8 and w.get("type") == "float" and w.get("strategy") in ("channel", "tensor")
            for w in schemes):
        return "fp8"
    raise UnsupportedModelError(
        f"unsupported quantization {method!r}: graphserve loads compressed-tensors checkpoints with FP8 weights "
        "(float, 8 bits, channel or tensor scales), or quantizes to FP8 itself (--quantization fp8)")
