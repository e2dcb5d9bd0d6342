"""Random-weight model folders with real model configs, for GPU tests and benchmarks
(real weights are too large to ship to the GPU machine). Written once per machine into
a cache folder ($GRAPHSERVE_RANDOM_MODELS) as safetensors + config.json + a synthetic
tokenizer of the model's vocabulary size (every id decodes to text, as with a real model),
then loaded by the engine's own loader. A folder whose tokenizer is older than
SYNTHETIC_TOKENIZER_VERSION gets a new tokenizer (the weights are kept)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

CONFIGS = {
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "sliding_window": None, "use_sliding_window": False,
    },
}

# 141 GB of bf16 weights: run with load_format="dummy" (random_model_config), over 2+ GPUs
CONFIGS["llama-3.1-70b"] = {**CONFIGS["llama-3.1-8b"], "hidden_size": 8192, "intermediate_size": 28672,
                            "num_hidden_layers": 80, "num_attention_heads": 64}

# Llama-3.2-1B: the draft model of Llama-3.1-8B (the same tokenizer), for speculative decoding
CONFIGS["llama-3.2-1b"] = {**CONFIGS["llama-3.1-8b"], "hidden_size": 2048, "intermediate_size": 8192,
                           "num_hidden_layers": 16, "head_dim": 64, "tie_word_embeddings": True,
                           "rope_scaling": {**CONFIGS["llama-3.1-8b"]["rope_scaling"], "factor": 32.0}}

# mixtures of experts (issue 41's shapes): made with load_format="dummy" (random_model_config) on the GPU
CONFIGS["qwen3-30b-a3b"] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "attention_bias": False, "sliding_window": None,
    "use_sliding_window": False, "max_window_layers": 48, "output_router_logits": False,
}
CONFIGS["mixtral-8x7b"] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "bos_token_id": 1,
    "eos_token_id": 2, "torch_dtype": "bfloat16", "hidden_act": "silu", "output_router_logits": False,
}
# gpt-oss-20b as released (its config.json): MXFP4 experts, attention sinks, sliding (128) and full layers
# alternating, YaRN; made with load_format="dummy" (random_model_config: random MXFP4 bytes and bf16 weights)
CONFIGS["gpt-oss-20b"] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "sliding_window": 128,
    "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "attention_bias": True, "attention_dropout": 0.0, "swiglu_limit": 7.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "pad_token_id": 199999, "eos_token_id": 200002, "torch_dtype": "bfloat16",
    "router_aux_loss_coef": 0.9, "output_router_logits": False, "initializer_range": 0.02, "use_cache": True,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
# Mixtral at half its depth (46 GB): fits an 80 GB card beside a KV pool, so ours and benchmarks/moe_peer.py
# can be compared on an H100; every layer is the whole model's, so a step's time is about half of it
CONFIGS["mixtral-8x7b-16-layers"] = {**CONFIGS["mixtral-8x7b"], "num_hidden_layers": 16}

# issue 61's shapes (load_format="dummy"): Gemma 3 12B's text model (5 sliding-window layers of 1024 to 1
# global, head_dim 256, a 262k vocabulary tied to the LM head) and Phi-4 (14B, fused qkv and gate_up)
CONFIGS["gemma-3-12b"] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 3840,
    "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 1024, "sliding_window_pattern": 6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
CONFIGS["phi-4"] = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 100352, "hidden_size": 5120,
    "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 10,
    "max_position_embeddings": 16384, "original_max_position_embeddings": 16384, "rope_theta": 250000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-5, "hidden_act": "silu", "sliding_window": None,
    "tie_word_embeddings": False, "bos_token_id": 100257, "eos_token_id": 100265, "pad_token_id": 100349,
    "torch_dtype": "bfloat16",
}


def models_root() -> Path:
    return Path(os.environ.get("GRAPHSERVE_RANDOM_MODELS", "/tmp/graphserve-random-models"))


def _tiny_models():
    tests = str(Path(__file__).resolve().parents[1] / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import tiny_models

    return tiny_models


def tokenizer_is_current(path: Path, name: str) -> bool:
    version = path / "tokenizer_version.txt"
    want = f"{_tiny_models().SYNTHETIC_TOKENIZER_VERSION} {CONFIGS[name]['vocab_size']}"
    return version.is_file() and version.read_text().strip() == want


def write_tokenizer(path: Path, name: str) -> None:
    """The synthetic tokenizer of config `name` into folder `path` (tokenizer.json,
    tokenizer_config.json, tokenizer_version.txt); no weights."""
    cfg = CONFIGS[name]
    path.mkdir(parents=True, exist_ok=True)
    _tiny_models().write_synthetic_tokenizer(path, cfg["vocab_size"], cfg.get("bos_token_id"), cfg["eos_token_id"])


def random_model(name: str, seed: int = 0) -> Path:
    """The folder for `name`, written on first use (random weights, bf16)."""
    path = models_root() / name
    if (path / "config.json").is_file():
        if not tokenizer_is_current(path, name):
            write_tokenizer(path, name)
        return path
    import transformers

    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = CONFIGS[name]
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        # std 0.02 everywhere except a wider embedding: confident next-token choices, so
        # bf16 rounding differences rarely flip a greedy argmax
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0) if "norm" in n else p.normal_(0, 0.02)
            else:
                p.normal_(0, 0.5 if "embed_tokens" in n or "lm_head" in n else 0.02)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="5GB")
    write_tokenizer(tmp, name)
    os.replace(tmp, path)
    return path


def random_model_config(name: str) -> Path:
    """A folder with `name`'s config.json and synthetic tokenizer and no weights, for an engine
    built with load_format="dummy" (random weights made on the devices; shapes whose weight
    files would not fit the disk)."""
    import json

    path = models_root() / f"{name}-config-only"
    if not (path / "config.json").is_file() or not tokenizer_is_current(path, name):
        write_tokenizer(path, name)
        (path / "config.json").write_text(json.dumps(CONFIGS[name], indent=1))
    return path


if __name__ == "__main__":  # python benchmarks/random_models.py NAME...: write them, print their folders
    for arg in sys.argv[1:] or list(CONFIGS):
        print(random_model(arg), flush=True)
