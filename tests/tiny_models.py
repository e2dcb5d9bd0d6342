"""Tiny random-weight Hugging Face model folders for fast tests (built in seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

TINY_VOCAB = 512

_BASE = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2)

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False, rope_theta=10000.0)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=False, head_dim=32)),
}


def _byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: one id per byte (ids 3..258), specials 0-2, the rest unused."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = 3 + i
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=1, continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", behavior="isolated")])
    tok.decoder = decoders.ByteLevel()
    return tok


def make_tiny_model(path: Path, variant: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    import transformers

    config_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, config_cls)(**_BASE, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype)
    with torch.no_grad():  # wider than default init: greedy continuations vary (logits stay fairly flat)
        for p in model.parameters():
            p.normal_(0, 0.15)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path


def write_byte_tokenizer(path: Path) -> None:
    """tokenizer.json + tokenizer_config.json (with a tiny chat template) for a model folder."""
    _byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}",
    }))
