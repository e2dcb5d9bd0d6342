"""The peer of the mixture-of-experts decode rows (issue 41): a decoder written the way gpt-fast's
`mixtral-moe` example writes one, compiled as it compiles it, timed on the same shapes and batches as
benchmarks/decode_latency.py times ours, in the same run on the same GPU.

    python benchmarks/moe_peer.py --model mixtral-8x7b --batches 1 64 --out peer.json

What makes it that example and not a tuned server:
- the experts as three stacked weights [experts, out, in], and each token's chosen experts gathered
  from them by index (`w1[expert_indices]`) and applied with einsum;
- routing as softmax, top-k, renormalized by the sum (Mixtral; Qwen3-MoE with `norm_topk_prob`);
- a static KV cache [batch, kv heads, max positions, head dim] written with index_copy_, attention by
  scaled_dot_product_attention over every position under a mask;
- the one-token step, greedy pick included, compiled with `torch.compile(mode="reduce-overhead",
  fullgraph=True)` (CUDA graphs), the position advanced on the device.
Random bf16 weights made on the GPU (the values do not change the time). Time is decode only: the
new tokens' steps after the prompt's positions, the best of `--repeats` runs after a warm-up run.
A batch whose gathered experts do not fit in memory is recorded with its error, not left out.
The same module runs on CPU in float32 (tests/test_moe_peer.py checks its logits against
transformers' on the same weights, so the time below is of a model that computes the right thing).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


class PeerConfig:
    def __init__(self, hf: dict):
        self.dim = hf["hidden_size"]
        self.layers = hf["num_hidden_layers"]
        self.heads = hf["num_attention_heads"]
        self.kv_heads = hf["num_key_value_heads"]
        self.head_dim = hf.get("head_dim") or self.dim // self.heads
        self.vocab = hf["vocab_size"]
        self.experts = hf.get("num_local_experts") or hf["num_experts"]
        self.top_k = hf["num_experts_per_tok"]
        self.inter = hf.get("moe_intermediate_size") or hf["intermediate_size"]
        self.eps = hf["rms_norm_eps"]
        self.theta = hf.get("rope_theta") or hf["rope_parameters"]["rope_theta"]  # (transformers 5: the latter)
        self.qk_norm = hf["model_type"] == "qwen3_moe"
        self.renormalize = hf.get("norm_topk_prob", True)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class ConditionalFeedForward(nn.Module):
    def __init__(self, c: PeerConfig):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(c.experts, c.inter, c.dim))  # gate
        self.w3 = nn.Parameter(torch.empty(c.experts, c.inter, c.dim))  # up
        self.w2 = nn.Parameter(torch.empty(c.experts, c.dim, c.inter))  # down

    def forward(self, x: torch.Tensor, expert_indices: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self.w1[expert_indices], self.w3[expert_indices], self.w2[expert_indices]  # [T, A, ., .]
        x1 = F.silu(torch.einsum("ti,taoi->tao", x, w1))
        x3 = torch.einsum("ti,taoi->tao", x, w3)
        return torch.einsum("tao,taio->tai", x1 * x3, w2)


class MoEFeedForward(nn.Module):
    def __init__(self, c: PeerConfig):
        super().__init__()
        self.gate = nn.Linear(c.dim, c.experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(c)
        self.top_k, self.renormalize = c.top_k, c.renormalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, indices = torch.topk(weights, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.einsum("tai,ta->ti", self.cond_ffn(x, indices), weights.to(x.dtype))
        return out.reshape(shape)


class Attention(nn.Module):
    def __init__(self, c: PeerConfig):
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * c.head_dim, c.dim, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.eps) if c.qk_norm else None

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, _ = x.shape
        c = self.c
        q = self.wq(x).view(b, t, c.heads, c.head_dim)
        k = self.wk(x).view(b, t, c.kv_heads, c.head_dim)
        v = self.wv(x).view(b, t, c.kv_heads, c.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        group = c.heads // c.kv_heads
        keys = self.k_cache.repeat_interleave(group, dim=1)
        values = self.v_cache.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the HF layout (the two halves of each head rotated together)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, c: PeerConfig):
        super().__init__()
        self.attention = Attention(c)
        self.feed_forward = MoEFeedForward(c)
        self.attention_norm = RMSNorm(c.dim, c.eps)
        self.ffn_norm = RMSNorm(c.dim, c.eps)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class PeerMoE(nn.Module):
    def __init__(self, c: PeerConfig):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.output = nn.Linear(c.dim, c.vocab, bias=False)

    def setup_caches(self, batch: int, max_positions: int) -> None:
        c, p = self.c, self.output.weight
        for layer in self.layers:
            shape = (batch, c.kv_heads, max_positions, c.head_dim)
            layer.attention.register_buffer("k_cache", torch.zeros(shape, dtype=p.dtype, device=p.device), False)
            layer.attention.register_buffer("v_cache", torch.zeros(shape, dtype=p.dtype, device=p.device), False)
        inv = 1.0 / (c.theta ** (torch.arange(0, c.head_dim, 2, device=p.device, dtype=torch.float) / c.head_dim))
        angles = torch.outer(torch.arange(max_positions, device=p.device, dtype=torch.float), inv)
        self.register_buffer("cos", angles.cos(), False)
        self.register_buffer("sin", angles.sin(), False)
        causal = torch.tril(torch.ones(max_positions, max_positions, dtype=torch.bool, device=p.device))
        self.register_buffer("causal", causal, False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        mask = self.causal[None, None, input_pos]
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x)).float()

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        """Weights from a transformers (5.x) MixtralForCausalLM / Qwen3MoeForCausalLM state dict, whose
        experts are stacked as gate_up_proj [experts, 2 x inter, dim] (gate first) and down_proj."""
        own = {"tok_embeddings.weight": state["model.embed_tokens.weight"], "norm.weight": state["model.norm.weight"],
               "output.weight": state["lm_head.weight"]}
        for i in range(self.c.layers):
            hf, mine = f"model.layers.{i}.", f"layers.{i}."
            for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"),
                         ("q_norm", "q_norm"), ("k_norm", "k_norm")):
                if f"{hf}self_attn.{b}.weight" in state:
                    own[f"{mine}attention.{a}.weight"] = state[f"{hf}self_attn.{b}.weight"]
            own[f"{mine}attention_norm.weight"] = state[f"{hf}input_layernorm.weight"]
            own[f"{mine}ffn_norm.weight"] = state[f"{hf}post_attention_layernorm.weight"]
            own[f"{mine}feed_forward.gate.weight"] = state[f"{hf}mlp.gate.weight"]
            gate, up = state[f"{hf}mlp.experts.gate_up_proj"].chunk(2, dim=1)
            own[f"{mine}feed_forward.cond_ffn.w1"], own[f"{mine}feed_forward.cond_ffn.w3"] = gate, up
            own[f"{mine}feed_forward.cond_ffn.w2"] = state[f"{hf}mlp.experts.down_proj"]
        self.load_state_dict(own)


def build(hf_config: dict, device: str, dtype: torch.dtype, seed: int = 0) -> PeerMoE:
    """The model with random weights made on `device` (std 0.02, norms 1, as decode_latency's dummy load)."""
    with torch.device("meta"):
        model = PeerMoE(PeerConfig(hf_config)).to(dtype)  # in the dtype before any memory is taken
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def decode_one_token(model: PeerMoE, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    return model(tokens, input_pos)[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def time_decode(model: PeerMoE, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                compile_step: bool) -> float:
    """Seconds a decode step (batch tokens): the best of `repeats` runs' averages over their new tokens.
    The prompt goes through the same one-token step, untimed: a whole prompt's forward would gather
    its tokens' experts all at once (prompt x top-k copies of an expert's weights), which gpt-fast's
    short prompts never meet."""
    device = model.output.weight.device
    model.setup_caches(batch, prompt_len + new_tokens)
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True) if compile_step else decode_one_token

    def run() -> float:
        token = torch.randint(0, model.c.vocab, (batch, 1), device=device)
        pos = torch.zeros(1, dtype=torch.long, device=device)
        for _ in range(prompt_len):
            token = step(model, token, pos).clone()
            pos += 1
        sync(device)
        start = time.perf_counter()
        for _ in range(new_tokens):
            token = step(model, token, pos).clone()
            pos += 1
        sync(device)
        return (time.perf_counter() - start) / new_tokens

    run()  # compiles and captures
    return min(run() for _ in range(repeats))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    from measure import copy_bandwidth, run_info, write_json
    from random_models import CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mixtral-8x7b", choices=[m for m in CONFIGS if "num_experts_per_tok" in CONFIGS[m]])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bandwidth = copy_bandwidth()["gb_per_s"] if cuda else None  # before the weights take the memory
    model = build(CONFIGS[args.model], device, dtype)
    rows = []
    for batch in args.batches:
        row = {"model": args.model, "batch": batch,
               "engine": f"gpt-fast-style peer ({'torch.compile, reduce-overhead' if cuda else 'eager'})",
               "quantization": "bf16" if cuda else "float32"}
        try:
            seconds = time_decode(model, batch, args.prompt_len, args.new_tokens, args.repeats, compile_step=cuda)
            row.update(ms_per_step=seconds * 1e3, tokens_per_s=batch / seconds)
        except torch.OutOfMemoryError as error:
            row["error"] = f"out of memory: {str(error).splitlines()[0]}"
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()
        print(row, flush=True)
        rows.append(row)
    info = run_info("moe_peer") if cuda else {"benchmark": "moe_peer"}
    write_json(args.out, dict(**info, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                              copy_bandwidth_gb_s=bandwidth, rows=rows))


if __name__ == "__main__":
    main()
