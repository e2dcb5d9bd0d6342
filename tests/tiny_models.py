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
    # Phi-3/Phi-4: fused qkv and gate_up in the checkpoint (pad_token_id: its default is past the tiny vocabulary)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(tie_word_embeddings=False, pad_token_id=0)),
    # Gemma 3's text model: 6 layers, 5 local (window 8, rope_local_base_freq) to 1 global
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        tie_word_embeddings=False, head_dim=16, num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=24,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}

# Mixtures of experts (tests/test_moe.py): Mixtral's intermediate_size is each expert's.
MOE_VARIANTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        tie_word_embeddings=False, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=False, head_dim=16, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True)),
}


def _byte_tokenizer(words: list[str] | tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level tokenizer: one id per byte (ids 3..258), specials 0-2, then `words` as ordinary
    vocabulary entries (ids 259..., ByteLevel-spelled: encoding goes byte by byte and never makes
    them, decoding writes their text), the rest unused."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = 3 + i
    for word in words:
        vocab["".join(_BYTES_TO_UNICODE[b] for b in word.encode())] = len(vocab)
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=1, continuing_subword_prefix=""))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                 pre_tokenizers.Split("", behavior="isolated")])
    tok.decoder = decoders.ByteLevel()
    return tok


def make_tiny_model(path: Path, variant: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                    **overrides) -> Path:
    """overrides: config fields over the variant's (e.g. num_key_value_heads=1)."""
    import transformers

    config_cls, model_cls, extra = {**VARIANTS, **MOE_VARIANTS}[variant]
    config = getattr(transformers, config_cls)(**{**_BASE, **extra, **overrides})
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


# ---- a synthetic vocabulary of a given size (random-weight models with real shapes) ----

SYNTHETIC_TOKENIZER_VERSION = "synthetic-bpe-v1"


def _synthetic_words(count: int, seed: int = 0) -> list[str]:
    """`count` distinct ByteLevel token strings that look like subwords: consonant-vowel
    syllables, one to three of them, as a word start ("Ġ" = a leading space) or a
    continuation, in a seeded random order (so ids mix short and long pieces)."""
    import itertools
    import random

    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]  # 90
    short = syllables + [a + b for a, b in itertools.product(syllables, repeat=2)]  # 8,190
    words = [p + w for w in short for p in ("Ġ", "")]
    if len(words) < count:
        need = count - len(words)
        total = len(syllables) ** 3  # 729,000 three-syllable words; pick `need` of them without repeats
        if need > total:
            raise ValueError(f"a synthetic vocabulary holds at most {len(words) + 2 * total} words")
        picks = rng.sample(range(2 * total), need)
        n = len(syllables)
        for k in picks:  # k // 2: which three syllables; k % 2: with a leading space or not
            i = k // 2
            words.append(("Ġ" if k % 2 else "") + syllables[i // (n * n)] + syllables[i // n % n] + syllables[i % n])
    rng.shuffle(words)
    return words[:count]


def synthetic_tokenizer(vocab_size: int, specials: dict[int, str], seed: int = 0) -> Tokenizer:
    """A byte-level BPE tokenizer (as Llama 3 and Qwen2 use) with exactly `vocab_size`
    ids, every one of which decodes to text: `specials` (id -> token, e.g. BOS/EOS) at
    their ids, the 256 byte tokens next (so any text encodes, one token per byte: there
    are no merges), the rest distinct subword-like strings, most with a leading space."""
    from tokenizers import AddedToken

    vocab: dict[str, int] = {}
    free = iter(i for i in range(vocab_size) if i not in specials)
    alphabet = [_BYTES_TO_UNICODE[b] for b in range(256)]
    words = _synthetic_words(vocab_size - len(specials) - len(alphabet), seed)
    for token, token_id in zip([*alphabet, *words], free):
        vocab[token] = token_id
    for token_id, token in specials.items():
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"special token id {token_id} is outside the vocabulary of {vocab_size}")
        vocab[token] = token_id
    if len(vocab) != vocab_size:
        raise ValueError(f"built {len(vocab)} distinct tokens for a vocabulary of {vocab_size}")
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for _, t in sorted(specials.items())])
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (ByteLevel's alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_BYTES_TO_UNICODE = _bytes_to_unicode()


def write_synthetic_tokenizer(path: Path, vocab_size: int, bos_token_id: int | None,
                              eos_token_ids: int | list[int], seed: int = 0) -> None:
    """tokenizer.json (synthetic_tokenizer) + tokenizer_config.json naming BOS and EOS (the
    first EOS id; the engine takes the others from config.json) + a version file, so a
    cached model folder can tell whether its tokenizer is current."""
    eos_ids = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
    specials = {i: ("<|eos|>" if n == 0 else f"<|eos_{n}|>") for n, i in enumerate(eos_ids)}
    if bos_token_id is not None and bos_token_id not in specials:
        specials[bos_token_id] = "<|bos|>"
    synthetic_tokenizer(vocab_size, specials, seed).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": specials.get(bos_token_id) if bos_token_id is not None else None,
        "eos_token": specials[eos_ids[0]], "add_bos_token": False,
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}",
    }))
    (path / "tokenizer_version.txt").write_text(f"{SYNTHETIC_TOKENIZER_VERSION} {vocab_size}\n")


# ---- an FP8 checkpoint as llm-compressor writes one (compressed-tensors) ----


def write_compressed_tensors_fp8(src: Path, dst: Path, quantize, strategy: str, ignore: list[str]) -> dict:
    """`src`'s folder re-written to `dst` with each weight whose name `quantize(name)` accepts in e4m3
    and its `weight_scale` ([out, 1] per channel, or one per tensor), and the compressed-tensors
    quantization_config (W8A8, dynamic per-token activations; `ignore` as the config's list).
    Returns the tensors written."""
    import shutil

    from safetensors.torch import load_file, save_file

    from graphserve.engine.models.fp8 import FP8, FP8_MAX, quantize_per_channel

    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not quantize(name):
            out[name] = t
        elif strategy == "channel":
            q, scale = quantize_per_channel(t)
            out[name], out[name + "_scale"] = q, scale[:, None]
        else:
            scale = t.abs().max().float() / FP8_MAX
            out[name], out[name + "_scale"] = (t / scale).to(FP8), scale.reshape(1)
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        "ignore": ignore}
    (dst / "config.json").write_text(json.dumps(config))
    return out


def transformers_greedy(path: Path, prompts: list[list[int]], max_new: int, **load) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt, alone, in float32 (EOS ignored); `load`:
    from_pretrained's other arguments."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    outs = []
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def assert_greedy_matches(llm, prompts: list[list[int]], params, want: list[list[int]], alone: int | None = None,
                          distinct: int = 1) -> None:
    """`llm`'s greedy tokens equal transformers' (`want`): prompt `alone` by itself (when given), then
    all prompts batched, twice (the second pass hits the prefix cache where it is on); and the
    prompts' continuations take more than `distinct` different values, so a test could tell them apart."""
    if alone is not None:
        assert llm.generate([prompts[alone]], params)[0].token_ids == want[alone]
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert len({tuple(o) for o in want}) > distinct


# ---- gpt-oss: a tiny GptOssForCausalLM, its experts unquantized or in MXFP4 as released ----

# swiglu_limit and swiglu_alpha at gpt-oss's (GptOssConfig's defaults, 7.0 and 1.702): transformers 5.17 (the GPU
# machine's) hard-codes those two in GptOssExperts whatever the config says, 5.25 reads them, so a tiny model with
# others would have no one reference across the versions the CPU and the GPU machines carry
GPT_OSS = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
               sliding_window=8, max_position_embeddings=512, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
               tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def make_tiny_gpt_oss(path: Path, mxfp4: bool = False, seed: int = 0, dtype: torch.dtype = torch.float32,
                      **overrides) -> Path:
    """A random GptOssForCausalLM (sliding and full layers alternating, YaRN, sinks, biases everywhere, experts
    whose gate and up projections reach swiglu_limit's clamp), saved by transformers; mxfp4: its experts' weights
    quantized (quantize_mxfp4) and stored as gpt-oss stores them, with quant_method mxfp4 in its config."""
    import transformers

    config = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms about 1; sinks matter; the experts' gate_up wide
            # enough (std 0.6 over hidden 64: outputs of std ~5) that about 7% of gates and 14% of ups pass the
            # limit of 7
            std = 1.0 if name.endswith("sinks") else 0.6 if name.endswith("experts.gate_up_proj") else 0.15
            p.normal_(1.0 if "norm" in name else 0.0, std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    if mxfp4:
        _experts_to_mxfp4(path)
    return path


def _experts_to_mxfp4(path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, t in load_file(str(path / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, in, out] -> blocks of [E, out, in]
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2).float())
        else:
            tensors[name] = t
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def dequantized_gpt_oss(src: Path, dest: Path) -> Path:
    """`src`'s MXFP4 gpt-oss folder copied to `dest` with its experts' weights dequantized by transformers' own
    convert_moe_packed_tensors into float32 (exactly the MXFP4 values) and no quantization_config: what
    transformers' Mxfp4Config(dequantize=True) load computes, as a checkpoint any transformers version reads in
    float32 (5.17's load dequantizes into bf16 whatever the model's dtype, and a float32 model then fails on its
    first expert)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dest)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):  # -> transformers' [E, in, out]
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=torch.float32)
        elif not name.endswith("_scales"):
            out[name] = t
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config")
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A reference MXFP4 quantizer (OCP MX spec): w [..., N, K] -> (blocks uint8 [..., N, K / 32, 16], scales
    uint8 [..., N, K / 32]). Each group of 32 along K gets the scale 2^s, s = ceil(log2(amax / 6)) (its
    largest value fits e2m1's 6), and each value the nearest e2m1 value of w / 2^s (the even code on a tie)."""
    from graphserve.kernels.mxfp4 import FP4_VALUES, GROUP

    groups = w.reshape(*w.shape[:-1], w.shape[-1] // GROUP, GROUP)
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)
    magnitudes = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)  # first (even) code on a tie
    codes = codes | ((scaled < 0) & (codes > 0)).to(torch.int64) << 3
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return packed, (exponent[..., 0] + 127).to(torch.uint8)


# ---- a "reasoning" model whose greedy output is known (tests/test_reasoning.py) ----

THINK_TEMPLATES = {
    # Qwen3's shape: the model opens <think> itself; enable_thinking=false closes an empty one in the prompt
    "qwen3": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}<assistant>"
             "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
    # DeepSeek-R1's: the template opens <think>, the output starts inside the thinking
    "deepseek-r1": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<assistant><think>\n{% endif %}",
}
# each token's successor in the greedy output (the model is a bigram table: every token of the chain is
# distinct). After "<assistant>" (its last token ">") the qwen3 model writes
# "<think>\nLet me think</think>\n\nThe answer is 42"; after a prompt that ends in "<think>\n" (deepseek-r1)
# "Let me think</think>\n\nThe answer is 42"; after "</think>\n\n" (enable_thinking=false) "The answer is 42".
THINK_WORDS = ["<think>", "</think>", "Let", " me", " think", "\n\n", "The", " answer", " is", " 42"]
THINK_CHAIN = [">", "<think>", "\n", "Let", " me", " think", "</think>", "\n\n", "The", " answer", " is", " 42", "</s>"]


def _bigram_llama(path: Path, edges: list[tuple[int, int, float]], eos_token_id: int | list[int] = 2) -> None:
    """A tiny llama (saved to `path`) whose next-token logits depend on the last token alone: every
    layer adds nothing to the residual (its output projections are zero), so the logits are
    lm_head(norm(embedding of the last token)). Each edge (a, b, weight) adds weight times a's unit
    embedding to lm_head's row of b: after a, b scores weight * sqrt(hidden_size) (32 for weight 4),
    a token whose edges start elsewhere only the cosine of two random embeddings times that (a few
    units), so greedy decoding follows a's strongest edge, and where a grammar forbids it, the next
    strongest."""
    import transformers

    config = transformers.LlamaConfig(**{**_BASE, **VARIANTS["llama"][2], "eos_token_id": eos_token_id})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0, 1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        for a, b, weight in edges:
            head[b] += weight * emb[a] / emb[a].norm()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)


def make_thinking_model(path: Path, template: str = "qwen3") -> Path:
    """A tiny bigram llama (_bigram_llama) whose greedy output follows THINK_CHAIN. The byte
    tokenizer has the THINK_WORDS as added (non-special) tokens."""
    from tokenizers import AddedToken

    tok = _byte_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in THINK_WORDS])
    ids = {}
    for piece in THINK_CHAIN:
        encoded = tok.encode(piece, add_special_tokens=False).ids if piece != "</s>" else [2]
        assert len(encoded) == 1, (piece, encoded)
        ids[piece] = encoded[0]
    _bigram_llama(path, [(ids[a], ids[b], 4.0) for a, b in zip(THINK_CHAIN, THINK_CHAIN[1:])])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": THINK_TEMPLATES[template]}))
    return path


# ---- a model that writes OpenAI's harmony format (gpt-oss's), for the gpt-oss reasoning parser ----

HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# gpt-oss's template's shape, kept small: the system message reads `reasoning_effort`; tools are listed in a
# developer message; each message is `<|start|>ROLE<|message|>TEXT<|end|>`, an assistant's in the final channel,
# its tool calls `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>` and their
# results `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>TEXT<|end|>`; the generation prompt
# is `<|start|>assistant` (the model writes the channel)
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}"
    "functions.{{ t.function.name }}: {{ t.function.parameters | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{% set last = namespace(name='') %}{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% set last.name = c.function.name %}{% endfor %}"
    "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

# The greedy output after the generation prompt (its last token the byte "t"): `<|channel|>analysis<|message|>Let
# me think<|end|><|start|>assistant<|channel|>final<|message|>The answer is 42<|return|>`. A bigram chain cannot
# repeat a token, so harmony's markers come as their control tokens the first time and spelled by ordinary
# vocabulary entries the second ("<|" "channel|>", "<|message" "|>"): the parser reads the text with the special
# tokens kept, which is the same. Where a grammar forbids "final" (a tool_choice that requires a call) the model
# takes its second choice, a call: `...<|start|>assistant<|channel|>commentary to=functions.get_weather
# <|constrain|>json<|message|>{"city": "Paris"}<|call|>`.
HARMONY_WORDS = ["analysis", "Let", " me", " think", "assistant", "<|", "channel|>", "final", "<|message", "|>", "The",
                 " answer", " is", " 42", "commentary", " to=functions.get_weather ", "json<|message|>",
                 '{"city": "Paris"}']
HARMONY_CHAIN = ["t", "<|channel|>", "analysis", "<|message|>", "Let", " me", " think", "<|end|>", "<|start|>",
                 "assistant", "<|", "channel|>", "final", "<|message", "|>", "The", " answer", " is", " 42",
                 "<|return|>"]
HARMONY_CALL = ["channel|>", "commentary", " to=functions.get_weather ", "<|constrain|>", "json<|message|>",
                '{"city": "Paris"}', "<|call|>"]


def _harmony_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    """The byte tokenizer with HARMONY_WORDS as ordinary vocabulary entries and harmony's control
    tokens as special tokens; and the id of each word, control token and the byte "t"."""
    from tokenizers import AddedToken

    tok = _byte_tokenizer(HARMONY_WORDS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_SPECIALS])
    ids = {word: 259 + i for i, word in enumerate(HARMONY_WORDS)}
    ids |= {t: tok.token_to_id(t) for t in [*HARMONY_SPECIALS, "t"]}
    return tok, ids


def _write_harmony_tokenizer(path: Path, tok: Tokenizer) -> None:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|return|>", "add_bos_token": False, "chat_template": HARMONY_TEMPLATE}))


def make_harmony_tokenizer(path: Path) -> Path:
    """A model folder's tokenizer files only: _harmony_tokenizer and HARMONY_TEMPLATE; EOS `<|return|>`."""
    _write_harmony_tokenizer(path, _harmony_tokenizer()[0])
    return path


def make_harmony_model(path: Path) -> Path:
    """A tiny bigram llama (_bigram_llama) that writes harmony: HARMONY_CHAIN, or where a grammar
    forbids "final", HARMONY_CALL (its edge from "channel|>" is the second strongest). Its EOS ids are
    `<|return|>` and `<|call|>`, as gpt-oss's generation config has them."""
    tok, ids = _harmony_tokenizer()
    edges = [(ids[a], ids[b], 4.0) for chain in (HARMONY_CHAIN, HARMONY_CALL[1:]) for a, b in zip(chain, chain[1:])]
    edges.append((ids["channel|>"], ids["commentary"], 2.0))
    _bigram_llama(path, edges, eos_token_id=[ids["<|return|>"], ids["<|call|>"]])
    _write_harmony_tokenizer(path, tok)
    return path
