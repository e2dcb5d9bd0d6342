"""Where the host time of an eager prefill forward goes (issue 10: a wave of cached prefills is
bound by launching the forward, not by the device). Builds the engine, then times with device
syncs around each: the whole forward of a cached-prefill-shaped batch (B sequences, S new tokens
each after a P-token prefix), its host launch alone, one decoder layer, and each kind of launch
it makes, repeated: the RMSNorm, rotary + KV store and prefill attention Triton kernels, a cuBLAS
projection, and making the step's small input tensors.

    python benchmarks/prefill_host_probe.py --model qwen2.5-0.5b --config configs/gpu-h200.toml --out $OUT
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from throughput import engine_config, engine_parser  # noqa: E402
from workload import provenance, resolve_model, write_json  # noqa: E402


def per_call_us(fn, repeats: int, sync) -> tuple[float, float]:
    """(host us per call while launching, us per call until the device is done)."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    launched = time.perf_counter()
    sync()
    done = time.perf_counter()
    return 1e6 * (launched - start) / repeats, 1e6 * (done - start) / repeats


def main() -> int:
    parser = engine_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    import torch

    from graphserve import LLM
    from graphserve.engine.models.attention import AttentionMetadata
    from graphserve.engine.models.layers import add_rms_norm, linear, rms_norm

    model = resolve_model(args.model)
    _, config = engine_config(args, model)
    llm = LLM(**dataclasses.asdict(config))
    core = llm.engine.core
    runner, net = core.runner, core.runner.model
    device = runner.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    b, p, s = args.batch, args.prefix, args.suffix
    ctx = p + s
    bs = core.block_manager.block_size
    blocks_per_seq = -(-ctx // bs)
    tables = torch.arange(1, 1 + b * blocks_per_seq, dtype=torch.int32).view(b, blocks_per_seq)
    tables = tables % (core.block_manager.num_blocks - 1) + 1
    tokens = b * s
    positions = torch.arange(p, ctx).repeat(b)
    slots = (tables.long()[:, (positions[:s] // bs)] * bs + (positions[:s] % bs)).flatten()
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=slots.to(device), block_tables=tables.to(device),
        context_lens=torch.full((b,), ctx, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(0, tokens + 1, s, dtype=torch.int32, device=device), max_seqlen_q=s,
        query_lens_host=[s] * b, context_lens_host=[ctx] * b)
    input_ids = torch.randint(100, 1000, (tokens,), device=device)
    positions = positions.to(device)
    rows = {}

    with torch.inference_mode():
        def forward():
            net(input_ids, positions, meta, runner.kv_caches)

        rows["forward"] = per_call_us(forward, args.repeats, sync)
        layer, (k_cache, v_cache) = net.layers[0], runner.kv_caches[0]
        x = torch.randn(tokens, net.args.hidden_size, device=device, dtype=core.dtype)
        rows["decoder layer"] = per_call_us(lambda: layer(x, x, positions, net.cos_sin, meta, k_cache, v_cache),
                                            args.repeats * 10, sync)
        norm = layer.input_layernorm
        rows["rms_norm"] = per_call_us(lambda: rms_norm(x, norm.weight, norm.eps), 200, sync)
        rows["add_rms_norm"] = per_call_us(lambda: add_rms_norm(x, x, norm.weight, norm.eps), 200, sync)
        proj = layer.self_attn.qkv_proj
        rows["qkv linear"] = per_call_us(lambda: linear(x, proj.weight, proj.bias), 200, sync)
        attn = layer.self_attn
        qkv = linear(x, proj.weight, proj.bias).view(tokens, attn.num_heads + 2 * attn.num_kv_heads, attn.head_dim)
        q, k, v = qkv.split([attn.num_heads, attn.num_kv_heads, attn.num_kv_heads], dim=1)
        backend = attn.backend
        if device.type == "cuda":
            rows["rope + kv store"] = per_call_us(
                lambda: backend._rope_store(q, k, v, positions, net.cos_sin, k_cache, v_cache, meta.slot_mapping),
                200, sync)
            rows["prefill attention"] = per_call_us(
                lambda: backend._prefill(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                         meta.context_lens, meta.max_seqlen_q, attn.scale), 200, sync)
        rows["small input tensors (5)"] = per_call_us(
            lambda: [torch.tensor(list(range(tokens)), dtype=torch.int64, device=device) for _ in range(5)], 50, sync)
    report = dict(**provenance("prefill_host_probe"), model=args.model, batch=b, prefix=p, suffix=s,
                  num_layers=len(net.layers),
                  rows={k: dict(host_us=round(h, 1), until_done_us=round(d, 1)) for k, (h, d) in rows.items()})
    for name, (host, done) in rows.items():
        print(f"{name:26s} host {host:9.1f} us   until done {done:9.1f} us", flush=True)
    write_json(Path(args.out) / (args.name or f"prefill-host-probe-{args.model}.json"), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
