"""The text a client receives inside constrained output is exactly the text the grammar
accepted, for a vocabulary with the 8B's size and special tokens (engine/structured/):
strict JSON (no raw control characters), schema-valid, no U+FFFD from bytes that are not
UTF-8, no special token the detokenizer would drop. Tool-call arguments as well.

A random-weight model samples tokens the grammar allows; here a sampler walks the grammar's
masks favouring the tokens that broke those promises (byte tokens of control characters and
of surrogate halves, BOS) and checks every walk's text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

xgr = pytest.importorskip("xgrammar", reason="xgrammar constrains the output")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a dev extra) validates the outputs")

from graphserve.engine.structured.grammar import GrammarCompiler, GrammarSpec
from graphserve.engine.tokenizer import Tokenizer
from tiny_models import write_synthetic_tokenizer

# Llama-3.1-8B's vocabulary: its size, BOS and its three stop ids
VOCAB_SIZE, BOS, EOS_IDS = 128_256, 128_000, [128_001, 128_008, 128_009]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "code": {"type": "string", "minLength": 4, "maxLength": 12},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "free": {"type": "string"},
        "count": {"type": "integer"},
    },
    "required": ["name", "code", "notes", "free", "count"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 16}, "k": {"type": "integer"}},
    "required": ["query", "k"], "additionalProperties": False}}}
WALKS, MAX_STEPS = 24, 400


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> tuple[GrammarCompiler, Tokenizer, list[bytes]]:
    folder: Path = tmp_path_factory.mktemp("vocab-8b")
    write_synthetic_tokenizer(folder, VOCAB_SIZE, BOS, EOS_IDS)
    compiler = GrammarCompiler(folder, VOCAB_SIZE, EOS_IDS)
    tokenizer = Tokenizer(str(folder))
    spelled = [_token_bytes(tokenizer, token_id) for token_id in range(VOCAB_SIZE)]  # as the grammar reads them
    yield compiler, tokenizer, spelled
    compiler.close()


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes of one token as a byte-level BPE spells it (specials: their text)."""
    from tiny_models import _BYTES_TO_UNICODE

    piece = tokenizer._tok.id_to_token(token_id)
    if piece is None:
        return b""
    if piece.startswith("<|") and piece.endswith("|>"):
        return piece.encode()
    to_byte = {c: b for b, c in _BYTES_TO_UNICODE.items()}
    return bytes(to_byte[c] for c in piece)


def _weights(spelled: list[bytes]) -> np.ndarray:
    """How much the walk favours each id: BOS, control characters and the bytes of
    multi-byte characters (surrogate halves among them) far above ordinary words, and the
    characters that close strings and objects enough that most walks finish."""
    weights = np.ones(len(spelled))
    for token_id, data in enumerate(spelled):
        if token_id == BOS:
            weights[token_id] = 20_000
        elif len(data) == 1:
            weights[token_id] = 200_000 if data in b'",]}0123456789' else 20_000
    return weights


def _walk(compiler: GrammarCompiler, spec: GrammarSpec, weights: np.ndarray, rng: np.random.Generator
          ) -> tuple[list[int], bool]:
    matcher = compiler.matcher(compiler.compile(spec))
    mask = torch.zeros((1, -(-VOCAB_SIZE // 32)), dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated():
            return tokens, True
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB_SIZE].astype(bool)
        p = np.where(allowed, weights, 0.0)
        token = int(rng.choice(VOCAB_SIZE, p=p / p.sum()))
        assert matcher.accept_token(token)
        tokens.append(token)
    return tokens, False


def _client_text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in EOS_IDS])


def _accepted_text(spelled: list[bytes], tokens: list[int], finished: bool = True) -> str:
    """What the grammar accepted, decoded strictly (raises on bytes that are not UTF-8) when
    it finished; a walk cut off may end inside a character, as a request cut by max_tokens."""
    data = b"".join(spelled[t] for t in tokens if t not in EOS_IDS)
    return data.decode("utf-8", errors="strict" if finished else "replace")


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_walks_reach_the_client_as_strict_valid_json(vocab, seed):
    compiler, tokenizer, spelled = vocab
    weights, rng = _weights(spelled), np.random.default_rng(seed)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    finished = 0
    for _ in range(WALKS):
        tokens, done = _walk(compiler, spec, weights, rng)
        text = _client_text(tokenizer, tokens)
        accepted = _accepted_text(spelled, tokens, done)
        assert text == accepted, "the client's text differs from what the grammar accepted"
        if done:
            finished += 1
            value = json.loads(text)  # strict: no raw control characters inside strings
            jsonschema.validate(value, SCHEMA)
    assert finished >= WALKS // 2, f"only {finished} of {WALKS} walks finished their JSON"


def test_tool_call_arguments_reach_the_client_as_strict_valid_json(vocab):
    compiler, tokenizer, spelled = vocab
    weights, rng = _weights(spelled), np.random.default_rng(7)
    tag = xgr.get_model_structural_tag("llama", tools=[TOOL], tool_choice="required", reasoning="disabled",
                                       parallel_tool_calls=False)
    spec = GrammarSpec("structural_tag", tag.model_dump_json(), param="tools")
    finished = 0
    for _ in range(WALKS):
        tokens, done = _walk(compiler, spec, weights, rng)
        text = _client_text(tokenizer, tokens)
        assert text == _accepted_text(spelled, tokens, done)
        if done:
            finished += 1
            call = json.loads(text)  # Llama 3.1's format: {"name": ..., "parameters": {...}}
            assert call["name"] == "lookup"
            jsonschema.validate(call["parameters"], TOOL["function"]["parameters"])
    assert finished >= WALKS // 2, f"only {finished} of {WALKS} walks finished their tool call"


def test_hangul_still_passes_the_surrogate_guard(vocab):
    """ED 80-9F starts valid characters (Hangul, U+D000-D7FF): only ED A0-BF is refused."""
    compiler, tokenizer, spelled = vocab
    byte_id = {data[0]: token_id for token_id, data in enumerate(spelled) if len(data) == 1}
    matcher = compiler.matcher(compiler.compile(GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}))))
    text = '{"s": "\ud55c\ud558"}'  # two Hangul syllables: ED 95 9C, ED 95 98, one byte token each
    ids = [byte_id[b] for b in text.encode()]
    for token in ids:
        assert matcher.accept_token(token)
    assert _accepted_text(spelled, ids) == text == _client_text(tokenizer, ids)
    surrogate = [byte_id[b] for b in b'{"s": "\xed']
    matcher = compiler.matcher(compiler.compile(GrammarSpec("json_schema", json.dumps(
        {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}))))
    for token in surrogate:
        assert matcher.accept_token(token)
    mask = torch.zeros((1, -(-VOCAB_SIZE // 32)), dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    allowed = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:VOCAB_SIZE].astype(bool)
    assert allowed[byte_id[0x95]] and not allowed[byte_id[0xA0]] and not allowed[byte_id[0xBF]]
