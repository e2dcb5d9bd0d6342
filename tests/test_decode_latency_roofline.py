"""benchmarks/decode_latency.py's roofline: the bytes a decode step must read (step_bytes), for the
real shapes of benchmarks/random_models.py built on the meta device (nothing allocated). A
mixture of experts reads only the experts its tokens choose; a dense model every parameter. The
expected figures are worked out here from the config numbers alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_latency  # noqa: E402
from random_models import CONFIGS  # noqa: E402

CONTEXT = 128 + 256 // 2  # the script's avg_context at its defaults: prompt 128, 256 new tokens


def _shape(tmp_path: Path, name: str, quantization: str | None = None):
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIGS[name]))  # all meta_shape reads
    return decode_latency.meta_shape(str(folder), quantization)


def _kv(cfg: dict, batch: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return batch * CONTEXT * 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2  # bf16 K, V


def _attention_params(cfg: dict) -> tuple[int, int, int]:
    """(qkv rows, o's inner dimension, the layer's other dense parameters: norms, biases) of one
    layer; qkv's inner dimension and o's rows are the hidden size."""
    h = cfg["hidden_size"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    qkv_rows = q + 2 * kv
    other = 2 * h  # input and post-attention RMSNorm
    if cfg["model_type"] == "qwen2":
        other += qkv_rows  # QKV bias
    if cfg["model_type"] in ("qwen3", "qwen3_moe"):
        other += 2 * d  # q and k norms
    return qkv_rows, q, other


def _moe_numbers(cfg: dict) -> tuple[int, int, int, int, int]:
    """(hidden, expert intermediate, experts, top-k, layers)."""
    inter = cfg.get("moe_intermediate_size", cfg["intermediate_size"])  # Mixtral's experts: intermediate_size
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    return cfg["hidden_size"], inter, experts, cfg["num_experts_per_tok"], cfg["num_hidden_layers"]


def _moe_expected(cfg: dict, batch: int, fp8: bool = False) -> float:
    """Dense weights + E * (1 - (1 - k/E)^B) experts a layer + the KV cache, from the config."""
    h, inter, experts, k, layers = _moe_numbers(cfg)
    qkv_rows, o_in, other = _attention_params(cfg)
    vocab = cfg["vocab_size"]
    assert not cfg["tie_word_embeddings"]  # the LM head is read whole, the input embedding by rows only
    if fp8:  # projections and experts: 1 byte a weight + a float32 scale per output row; router, norms bf16
        attention = (qkv_rows * h + qkv_rows * 4) + (h * o_in + h * 4)
        expert = 3 * h * inter + (2 * inter + h) * 4
    else:
        attention = 2 * (qkv_rows * h + h * o_in)
        expert = 2 * 3 * h * inter  # gate, up, down
    dense = layers * (attention + 2 * other + 2 * experts * h) + 2 * h + 2 * vocab * h  # + router; final norm, LM head
    chosen = experts * (1 - (1 - k / experts) ** batch)
    return dense + layers * chosen * expert + _kv(cfg, batch)


def test_experts_read_is_the_expected_number_of_distinct_picks():
    read = decode_latency.experts_read
    assert read(128, 8, 1) == pytest.approx(8) and read(8, 2, 1) == pytest.approx(2)
    assert 125.5 < read(128, 8, 64) < 126.5  # the issue: 64 x 8 picks cover about 126 of 128 experts
    assert read(8, 2, 64) == pytest.approx(8)
    # against sampling: B tokens, each k distinct experts uniformly at random
    gen = torch.Generator().manual_seed(0)
    for experts, k, batch in ((128, 8, 4), (128, 8, 16), (8, 2, 2)):
        picks = torch.rand(2000, batch, experts, generator=gen).topk(k, dim=-1).indices.flatten(1)
        hit = torch.zeros(2000, experts).scatter_(1, picks, 1.0).sum(1).mean().item()
        assert hit == pytest.approx(read(experts, k, batch), rel=0.01)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_moe_step_reads_the_dense_weights_and_the_chosen_experts(tmp_path, name):
    cfg = CONFIGS[name]
    shape = _shape(tmp_path, name)
    h, inter, experts, k, layers = _moe_numbers(cfg)
    assert shape.expert_bytes == layers * 2 * 3 * h * inter  # one bf16 expert of every layer
    for batch in (1, 64):
        assert decode_latency.step_bytes(shape, batch, CONTEXT) == pytest.approx(_moe_expected(cfg, batch), rel=1e-9)
    # batch 1 reads top-k experts a layer, far less than the whole model; batch 64 nearly all of it
    whole = shape.dense_bytes + experts * shape.expert_bytes
    assert decode_latency.step_bytes(shape, 1, CONTEXT) < 0.3 * whole
    assert decode_latency.step_bytes(shape, 64, CONTEXT) > 0.97 * whole


def test_moe_step_bytes_are_the_issue_figures(tmp_path):
    """The issue's figures (bf16; KV at prompt 128 + 256 new is small): Qwen3-30B-A3B ~6.1 GB at
    batch 1, ~60 GB at 64; Mixtral-8x7B ~25.6 GB and ~93 GB."""
    want = {"qwen3-30b-a3b": (6.1e9, 60e9), "mixtral-8x7b": (25.6e9, 93e9)}
    for name, (one, sixty_four) in want.items():
        shape = _shape(tmp_path, name)
        assert decode_latency.step_bytes(shape, 1, CONTEXT) == pytest.approx(one, rel=0.03)
        assert decode_latency.step_bytes(shape, 64, CONTEXT) == pytest.approx(sixty_four, rel=0.03)


def test_fp8_moe_counts_fp8_experts_with_their_scales_and_a_bf16_router(tmp_path):
    cfg = CONFIGS["qwen3-30b-a3b"]
    shape = _shape(tmp_path, "qwen3-30b-a3b", "fp8")
    h, inter, _, _, layers = _moe_numbers(cfg)
    assert shape.expert_bytes == layers * (3 * h * inter + (2 * inter + h) * 4)
    for batch in (1, 64):
        assert decode_latency.step_bytes(shape, batch, CONTEXT) == pytest.approx(
            _moe_expected(cfg, batch, fp8=True), rel=1e-9)


def test_dense_step_reads_every_parameter_and_the_kv_cache(tmp_path):
    """Qwen2.5-0.5B (tied: the embedding is the LM head, read whole): its 494,032,768 parameters in
    bf16, from the config; no experts."""
    cfg = CONFIGS["qwen2.5-0.5b"]
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    qkv_rows, o_in, other = _attention_params(cfg)
    params = layers * (qkv_rows * h + h * o_in + 3 * h * inter + other) + vocab * h + h
    assert params == 494_032_768
    shape = _shape(tmp_path, "qwen2.5-0.5b")
    assert shape.expert_bytes == 0
    for batch in (1, 64):
        assert decode_latency.step_bytes(shape, batch, CONTEXT) == 2 * params + _kv(cfg, batch)


def test_gpt_oss_counts_its_mxfp4_experts_as_stored_and_its_windows_kv(tmp_path):
    """gpt-oss-20b as released: each expert's MXFP4 blocks (half a byte a weight) and scales (a byte per 32),
    its bf16 biases; attention with q/k/v/o biases and sinks, a biased router; the sliding layers read their
    window's last 128 tokens of KV, the full ones the whole context."""
    cfg = CONFIGS["gpt-oss-20b"]
    shape = _shape(tmp_path, "gpt-oss-20b")
    h, inter, experts, k, layers = _moe_numbers(cfg)
    expert = (2 * inter * h + h * inter) // 2 + (2 * inter * h + h * inter) // 32 + 2 * (2 * inter + h)
    assert shape.expert_bytes == layers * expert
    qkv_rows, o_in, _ = _attention_params(cfg)
    heads = cfg["num_attention_heads"]
    layer = 2 * (qkv_rows * h + qkv_rows + h * o_in + h + heads + experts * h + experts + 2 * h)
    dense = layers * layer + 2 * h + 2 * cfg["vocab_size"] * h
    assert shape.dense_bytes == dense
    window_tokens = sum(min(CONTEXT, 128) if t == "sliding_attention" else CONTEXT for t in cfg["layer_types"])
    for batch in (1, 64):
        kv = batch * window_tokens * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
        chosen = experts * (1 - (1 - k / experts) ** batch)
        assert decode_latency.step_bytes(shape, batch, CONTEXT) == pytest.approx(dense + layers * chosen * expert + kv,
                                                                                 rel=1e-9)
    assert decode_latency.step_bytes(shape, 1, CONTEXT) == pytest.approx(3.7e9, rel=0.03)  # 13.3 MB an expert
