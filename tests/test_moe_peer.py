"""benchmarks/moe_peer.py, the gpt-fast-style peer of the mixture-of-experts decode rows: on the
same tiny weights its logits are transformers' own (Mixtral and Qwen3-MoE, float32, CPU), and its
one-token steps over the static KV cache give the logits of the whole sequence's forward. A peer that
computed something else could be faster for the wrong reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import moe_peer  # noqa: E402

TOKENS = [[5, 17, 42, 99, 3, 64, 28, 7, 80, 11]]


def tiny(arch: str):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=128, rms_norm_eps=1e-6)
    if arch == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
    else:
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4,
                                             norm_topk_prob=arch == "qwen3_moe_norm", head_dim=16, **common)
    torch.manual_seed(3)
    hf = getattr(transformers, "MixtralForCausalLM" if arch == "mixtral" else "Qwen3MoeForCausalLM")(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.15)
    return hf.eval(), config.to_dict()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe_norm", "qwen3_moe_no_norm"])
def test_peer_steps_give_transformers_logits(arch):
    hf, config = tiny(arch)
    peer = moe_peer.PeerMoE(moe_peer.PeerConfig(config)).eval()
    peer.load_hf(hf.state_dict())
    tokens = torch.tensor(TOKENS)
    with torch.no_grad():
        expected = hf(tokens).logits
        peer.setup_caches(batch=1, max_positions=16)
        whole = peer(tokens, torch.arange(tokens.shape[1]))
        peer.setup_caches(batch=1, max_positions=16)
        steps = torch.cat([peer(tokens[:, i:i + 1], torch.tensor([i])) for i in range(tokens.shape[1])], dim=1)
    torch.testing.assert_close(whole, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steps, expected, rtol=1e-4, atol=1e-4)
    assert expected.std() > 500 * 1e-4  # logits spread far past the tolerance, so a wrong route or norm shows


def test_time_decode_runs_the_uncompiled_step_on_cpu():
    _, config = tiny("qwen3_moe_norm")
    model = moe_peer.build(config, "cpu", torch.float32)
    seconds = moe_peer.time_decode(model, batch=2, prompt_len=4, new_tokens=3, repeats=1, compile_step=False)
    assert 0 < seconds < 5
