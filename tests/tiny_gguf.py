"""Tiny GGUF files for fast tests, written with the `gguf` package's GGUFWriter from a tiny
random-weight transformers model (tests/tiny_models.py), laid out as llama.cpp's
convert_hf_to_gguf.py lays them out: its tensor names, Llama's q/k rows permuted, norms in F32,
the other matrices in the asked-for type, a byte-level BPE vocabulary (tokenizer.ggml.model
"gpt2") and a ChatML chat template.

    hf_model, gguf_path = write_tiny_gguf(tmp_path, "llama", "Q8_0")

`hf_model` is the transformers model holding the weights the GGUF's dequantize to (Q8_0
rounding applied), so it is the reference for greedy parity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tiny_models import TINY_VOCAB, make_tiny_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "llama3": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
          "qwen3": gguf.MODEL_ARCH.QWEN3}
_TEXT = (
    "The quick brown fox jumps over the lazy dog. A language model reads text and writes more of it. "
    "Paris is the capital of France; Rome is the capital of Italy. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100. "
    "def add(a, b):\n    return a + b\n"
)


def tiny_bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE of TINY_VOCAB ids trained on a few sentences: specials 0-2, the 256 byte
    tokens, then merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = " ".join(a + b for a in syllables for b in syllables[::7])  # enough pairs to learn every merge
    tokenizer.train_from_iterator([_TEXT, words], trainer)
    assert tokenizer.get_vocab_size() == TINY_VOCAB, tokenizer.get_vocab_size()
    return tokenizer


def _llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order for Llama's q and k (convert_hf_to_gguf.py LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _llama3_rope_divisors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for llama3 rope scaling (convert_hf_to_gguf.py LlamaModel)."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / rope["low_freq_factor"]
    high_freq_wavelen = old_context_len / rope["high_freq_factor"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            divisors.append(1)
        elif wavelen > low_freq_wavelen:
            divisors.append(rope["factor"])
        else:
            smooth = (old_context_len / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def _add_tokenizer(writer: gguf.GGUFWriter, add_bos_token: bool) -> None:
    tokenizer = tiny_bpe_tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(add_bos_token)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(folder: Path, variant: str = "llama", tensor_type: str = "F32", seed: int = 0,
                    *, add_bos_token: bool = False, architecture: str | None = None,
                    raw_tensor: tuple[str, str] | None = None, **config_overrides) -> tuple[torch.nn.Module, Path]:
    """Write `folder/tiny-VARIANT.TYPE.gguf`; return (the transformers reference model, its path).

    tensor_type: "F32", "F16" or "Q8_0" for the 2-D weights. add_bos_token: the file's
    tokenizer.ggml.add_bos_token (prompts then start with <|im_start|>, the BOS). architecture:
    overrides the file's general.architecture (to craft an unsupported one). raw_tensor: (GGUF
    tensor name, type name) writes that tensor as zero bytes of that type instead (to craft one
    no library dequantizes). config_overrides: config fields over tiny_models' (e.g. rope_scaling).
    """
    from transformers import AutoModelForCausalLM

    hf_folder = make_tiny_model(folder / f"hf-{variant}-{seed}", variant, seed=seed, **config_overrides)
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    config = model.config
    arch = _ARCHS[variant]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    path = folder / f"tiny-{variant}.{tensor_type}.gguf"
    writer = gguf.GGUFWriter(path, architecture or gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(f"tiny-{variant}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if variant == "qwen3":  # its head_dim is not hidden_size / heads (as convert_hf_to_gguf.py writes it)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    _add_tokenizer(writer, add_bos_token)
    rope = config.rope_parameters
    if rope.get("rope_type") == "llama3":  # as llama.cpp stores it: a tensor, no metadata
        writer.add_tensor("rope_freqs.weight", _llama3_rope_divisors(rope, head_dim))
    elif rope.get("rope_type", "default") != "default":
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")
    dequantized = {}
    for hf_name, tensor in state.items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        data = tensor.numpy()
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith("attn_q.weight"):
            data = _llama_permute(data, config.num_attention_heads)
        elif arch == gguf.MODEL_ARCH.LLAMA and name.endswith("attn_k.weight"):
            data = _llama_permute(data, config.num_key_value_heads)
        if raw_tensor is not None and raw_tensor[0] == name:
            raw_type = gguf.GGMLQuantizationType[raw_tensor[1]]
            block, size = gguf.GGML_QUANT_SIZES[raw_type]
            writer.add_tensor(name, np.zeros((data.shape[0], data.shape[1] // block * size), np.uint8),
                              raw_dtype=raw_type)
            continue
        if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
            continue
        stored = gguf.quants.quantize(data, qtype)
        writer.add_tensor(name, stored, raw_dtype=qtype)
        dequantized[hf_name] = gguf.quants.dequantize(stored, qtype)
        if arch == gguf.MODEL_ARCH.LLAMA and ("q_proj" in hf_name or "k_proj" in hf_name):  # transformers' order
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            dequantized[hf_name] = _llama_unpermute(dequantized[hf_name], heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with torch.no_grad():  # the reference holds what the file dequantizes to
        for hf_name, data in dequantized.items():
            model.get_parameter(hf_name).copy_(torch.from_numpy(data))
    return model, path


def _llama_unpermute(weights: np.ndarray, n_head: int) -> np.ndarray:
    return (weights.reshape(n_head, weights.shape[0] // n_head // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@pytest.fixture(scope="module", autouse=True)
def gguf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Conversions go to a cache of the importing test module's own (child processes inherit it);
    a test module that imports this fixture gets it for all its tests."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRAPHSERVE_CACHE", str(root))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield root
