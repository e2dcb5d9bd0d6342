"""Decode latency and throughput on a GPU: our engine with CUDA graphs, our engine eager,
and transformers `generate` (eager), in one run, for real model shapes with random weights.

    python benchmarks/decode_latency.py --models qwen2.5-0.5b llama-3.1-8b --out benchmarks/results/decode.json

Decode time is measured as T(prompt + 1 + N tokens) - T(prompt + 1 token), so prefill is
excluded. Every timed run draws fresh prompts, so with prefix caching on nothing hits;
`--prefix-caching both` times every engine row with it on and off (issue 10: the lookup must
cost nothing measurable when nothing hits). Roofline: bytes a step must read (weights + KV cache; of a
mixture of experts only the experts its tokens choose: step_bytes) over the copy bandwidth
measured in the same run. `--tp N` (issue 11) also times the graph rows with the model sharded over
N GPUs (N processes, NCCL; on CPU gloo), after the one-GPU rows of the same run, and reports
each as a multiple of the one-GPU tok/s (`tp_speedup`).

    python benchmarks/decode_latency.py --models llama-3.1-8b --tp 2 --skip-transformers --chunks 8

`--quantization none fp8` times every model once per setting (fp8: the engine built with
`quantization="fp8"`, projection weights in float8 e4m3 with float32 per-channel scales; the
roofline counts those bytes); each row's `quantization` is "fp8" or the engine dtype ("bf16").
The transformers rows are bf16 only (timed with the `none` setting). A decode-latency curve
(graph rows only; plot with benchmarks/plot_decode.py):

    python benchmarks/decode_latency.py --models llama-3.1-8b --batches 1 2 4 8 16 32 64 128 256 --chunks 8 \
        --no-eager --skip-transformers --quantization none fp8 --out benchmarks/results/decode_curve.json
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from measure import copy_bandwidth, run_info, write_json  # noqa: E402
from workload import provenance, resolve_model  # noqa: E402


# The A/B switches: --FLAG sets MODULE.NAME for the run (bool: on / off; int: the value); unset, the
# shipped value stays.
SWITCHES = {
    "pdl-elementwise": ("graphserve.kernels.launch_settings", "PDL_ELEMENTWISE", bool, "PDL for the kernels between the projections too"),
    "fp8-weight-only-max-rows": ("graphserve.engine.models.fp8", "FP8_WEIGHT_ONLY_MAX_ROWS", int, "0: W8A8 from 2 rows"),
    "fp8-gemv-max-rows": ("graphserve.engine.models.layers", "FP8_GEMV_MAX_ROWS", int,
                          "0: batch 1 goes W8A8 through the norm's quantization and the skinny GEMM"),
    "fp8-gate-up-gemv-max-rows": ("graphserve.engine.models.layers", "FP8_GATE_UP_GEMV_MAX_ROWS", int,
                                  "1: batch 1's gate_up takes the GEMV, as the other projections do"),
    "skinny-gemm-max-rows": ("graphserve.engine.models.layers", "SKINNY_GEMM_MAX_ROWS", int,
                             "bf16 rows that take the skinny GEMM instead of cuBLAS"),
    "fp8-norm-quant": ("graphserve.engine.models.layers", "FP8_NORM_QUANT", bool,
                       "the RMSNorm before an FP8 projection quantizes its input (off: a separate kernel)"),
    "gemv-k-constexpr-max-k": ("graphserve.kernels.gemv", "K_CONSTEXPR_MAX_K", int,
                               "the one-row GEMV compiled for its K where K is at most this; 0: never"),
    "skinny-w8a8-tma-min-rows": ("graphserve.kernels.skinny_gemm", "W8A8_TMA_MIN_ROWS", int,
                                 "W8A8 qkv / o / down from this many rows load their K tiles with the copy engine "
                                 "(TMA); 0: never"),
    "skinny-w8a8-tma-silu-min-rows": ("graphserve.kernels.skinny_gemm", "W8A8_TMA_SILU_MIN_ROWS", int,
                                      "the same for gate_up with SiLU-and-mul; 0: never"),
    "gemv-long-k-block": ("graphserve.kernels.gemv", "LONG_K_BLOCK_K", int, "bf16 down_proj's K tile at batch 1"),
    "fp8-attention-amax": ("graphserve.engine.models.layers", "FP8_ATTENTION_AMAX", bool,
                           "decode attention hands an FP8 o_proj each KV head group's amax (one split)"),
    "attention-prefetch": ("graphserve.kernels.decode_attention", "PREFETCH_TILES", int,
                           "tiles of KV rows each program asks L2 for before its PDL wait; 0: none"),
    "attention-min-split-tokens": ("graphserve.kernels.decode_attention", "_MIN_TOKENS_PER_SPLIT", int,
                                   "the fewest KV tokens per split"),
    "attention-fused-merge": ("graphserve.kernels.decode_attention", "FUSED_MERGE", bool,
                              "the last split merges the partials; off: the merge kernel"),
    "fp8-quant-row-chunks": ("graphserve.kernels.fp8_quant", "ROW_CHUNKS", bool,
                             "a program per chunk of a row at few rows; off: one program a row"),
    "fp8-row-amax": ("graphserve.engine.models.layers", "FP8_ROW_AMAX", bool,
                     "an FP8 gate_up hands down_proj's row quantization each row's amax in parts"),
    "pdl-embedding": ("graphserve.engine.models.layers", "PDL_EMBEDDING", bool,
                      "the embedding lookup as a PDL kernel; off: torch's index_select"),
    "greedy-chunk": ("graphserve.kernels.sampling", "CHUNK", int, "vocabulary entries a program of the greedy argmax covers"),
    "greedy-fused-merge": ("graphserve.kernels.sampling", "FUSED_MERGE", bool,
                           "the greedy argmax's last chunk of a row merges, one PDL kernel; off: a merge kernel"),
    "fp8-quant-programs-per-sm": ("graphserve.kernels.fp8_quant", "ROW_CHUNK_PROGRAMS_PER_SM", int,
                                  "the programs an SM the row chunks aim at"),
    "skinny-w8a8-deep": ("graphserve.kernels.skinny_gemm", "W8A8_DEEP_PIPELINE", bool,
                         "W8A8 K tiles of 128 bytes 8 stages deep; off: 256 x 5"),
    "fused-step-bookkeeping": ("graphserve.engine.runner.model_runner", "FUSED_STEP_BOOKKEEPING", bool,
                               "a step's input rows and token records in two kernels; off: seven torch ops"),
    "defer-split-reduce": ("graphserve.engine.models.layers", "DEFER_SPLIT_REDUCE", bool,
                           "the norm after o / down sums their split-K partials; off: a reduce kernel each"),
    "norm-max-warps": ("graphserve.kernels.rmsnorm", "MAX_WARPS", int, "warps a row's RMSNorm program takes at most"),
    "pdl-early-trigger": ("graphserve.kernels._pdl", "EARLY_TRIGGER", bool,
                          "a PDL kernel lets the next one launch before its own wait"),
    "gpt-oss-gemv": ("graphserve.kernels.gpt_oss_experts", "GEMV_PATH", bool,
                     "gpt-oss's MXFP4 experts at 1-2 tokens on the CUDA cores (kernels/gpt_oss_gemv.py)"),
    "gpt-oss-small-path": ("graphserve.kernels.gpt_oss_experts", "SMALL_PATH", bool,
                           "gpt-oss's experts up to 16 tokens without moe_align; off: the grouped path"),
    "gpt-oss-mxfp4-k-tile-bytes": ("graphserve.kernels.gpt_oss_experts", "MXFP4_K_TILE_BYTES", int,
                                   "bytes of an MXFP4 weight row a K tile of the tensor-core paths reads"),
}


class EngineTiming(NamedTuple):
    """Seconds a decode step; of it, from the engine's DeviceTimeline, the seconds the device computed
    and sat idle between batches while requests ran (None where not measured: tensor parallelism)."""

    step_s: float
    busy_s: float | None = None
    idle_s: float | None = None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepShape(NamedTuple):
    """The weights of a model as a decode step reads them (step_bytes): `dense_bytes` every step reads
    whole (attention, norms, routers, the LM head; the input embedding only where it is also the LM
    head: a step reads just its tokens' rows of it), `expert_bytes` one routed expert of every MoE
    layer, summed over the layers (gate, up and down with their FP8 scales, or gpt-oss's MXFP4 blocks and
    scales as stored, and biases; 0 for a dense model), and the model's ModelArgs (layers, KV heads,
    windows; `moe`: experts and top-k)."""

    dense_bytes: int
    expert_bytes: int
    args: object


_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_scale", "down_scale")  # moe.SparseMoE's stacked experts


def model_shape(model) -> StepShape:
    """A LlamaModel's StepShape (its parameters' sizes only: a model on the meta device will do)."""
    from graphserve.engine.models.moe.gpt_oss import GptOssMoE
    from graphserve.engine.models.moe.sparse import SparseMoE

    def nbytes(p) -> int:
        return p.numel() * p.element_size()

    experts, expert_bytes = set(), 0
    for module in model.modules():
        if isinstance(module, (SparseMoE, GptOssMoE)):
            stacked = module.expert_parameters() if isinstance(module, GptOssMoE) else \
                [p for p in (getattr(module, n) for n in _EXPERT_PARAMS) if p is not None]
            experts.update(id(p) for p in stacked)
            expert_bytes += sum(nbytes(p) for p in stacked) // module.moe.num_experts
    dense = sum(nbytes(p) for n, p in model.named_parameters()
                if id(p) not in experts and not (n.startswith("embed_tokens") and model.lm_head is not None))
    return StepShape(dense, expert_bytes, model.args)


def experts_read(num_experts: int, top_k: int, batch: int) -> float:
    """The expected number of distinct experts of a layer that `batch` tokens route to, each token
    picking `top_k` distinct experts of `num_experts` uniformly and independently: an expert is missed
    by a token with probability 1 - k/E, so E * (1 - (1 - k/E)^B) (k at batch 1; at E=128, k=8, B=64
    about 126)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** batch)


def step_bytes(shape: StepShape, batch: int, avg_context: int) -> float:
    """The bytes a decode step of `batch` sequences of `avg_context` tokens must read, dense and MoE
    models alike: the dense weights, the experts its tokens choose (experts_read per MoE layer, with
    routing spread uniformly) and the KV cache."""
    moe = shape.args.moe
    experts = experts_read(moe.num_experts, moe.top_k, batch) * shape.expert_bytes if moe is not None else 0
    return shape.dense_bytes + experts + kv_bytes(shape.args, batch, avg_context)


DTYPE_LABELS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def quantization_label(quantization: str | None, dtype: torch.dtype) -> str:
    """A row's `quantization`: "fp8", or the engine dtype ("bf16") when the weights are not quantized."""
    return quantization or DTYPE_LABELS.get(dtype, str(dtype).removeprefix("torch."))


def kv_bytes(args, batch: int, avg_context: int) -> int:
    """bf16 K and V of every layer for `batch` sequences of `avg_context` tokens (a sliding-window
    layer reads at most its window's)."""
    windows = [args.window(layer) for layer in range(args.num_layers)]
    tokens = sum(avg_context if w is None else min(w, avg_context) for w in windows)
    return batch * tokens * 2 * args.num_kv_heads * args.head_dim * 2


def time_engine(llm, prompts, new_tokens: int, repeats: int = 2) -> EngineTiming:
    """prompts: a function giving fresh prompts for each run (no prefix-cache hits). Busy and idle
    come from the fastest runs; idle is time the host kept no work queued, and wall time past busy +
    idle is host time before the first batch and after the last."""
    from graphserve import SamplingParams

    timeline = llm.engine.core.worker.timeline

    def run(n):
        batch = prompts()
        _sync()
        timeline.poll()
        busy, idle = timeline.busy_seconds, timeline.idle_seconds
        t = time.perf_counter()
        llm.generate(batch, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        _sync()
        elapsed = time.perf_counter() - t
        timeline.poll()
        return elapsed, timeline.busy_seconds - busy, timeline.idle_seconds - idle

    run(17)  # warm-up: compiles, allocator
    prefill = min(run(1) for _ in range(repeats))
    full = min(run(new_tokens + 1) for _ in range(repeats))
    return EngineTiming(*((f - p) / new_tokens for f, p in zip(full, prefill)))


def _tp_rank(rank: int, size: int, init_method: str, path: str | None, device: str, batches: list[int], k: int,
             prompt_len: int, new_tokens: int, engine: dict) -> dict[int, float]:
    """One rank of a tensor-parallel engine (its own process): the same prompts and runs as every
    other rank; seconds per decode step for each batch."""
    from graphserve import LLM

    llm = LLM(path, device=device, tensor_parallel_size=size, tp_rank=rank, tp_init_method=init_method, **engine)
    llm.engine.core.config.decode_chunk = k
    gen = torch.Generator().manual_seed(1)
    return {batch: time_engine(llm, lambda b=batch: torch.randint(100, 30000, (b, prompt_len), generator=gen).tolist(),
                               new_tokens).step_s for batch in batches}


def time_tensor_parallel(size: int, path: str | None, device: str, batches: list[int], k: int, prompt_len: int,
                         new_tokens: int, engine: dict) -> dict[int, float]:
    """Seconds per decode step for each batch, with the model sharded over `size` ranks (rank 0's)."""
    from graphserve.engine.distributed import run_on_ranks

    return run_on_ranks(_tp_rank, size, (path, device, batches, k, prompt_len, new_tokens, engine), timeout=1800)[0]


def meta_shape(path: str | None, quantization: str | None) -> StepShape:
    """The StepShape of the whole bf16 (or FP8) model, from its config alone (a model built on the
    meta device: nothing allocated). FP8 covers what the loader quantizes: the projections and the
    routed experts, not an MoE router."""
    from graphserve.engine.models.config import ModelArgs
    from graphserve.engine.models.layers import Linear
    from graphserve.engine.models.llama import LlamaModel
    from graphserve.engine.models.moe.sparse import SparseMoE

    args = ModelArgs.from_dir(Path(path))
    with torch.device("meta"):
        model = LlamaModel(args, None, torch.empty(1, args.head_dim)).to(torch.bfloat16)
        if quantization == "fp8":
            routers = {id(m.router) for m in model.layers.modules() if isinstance(m, SparseMoE)}
            for module in model.layers.modules():
                if isinstance(module, SparseMoE) or (isinstance(module, Linear) and id(module) not in routers):
                    module.to_fp8(quantize=False)  # the FP8 weights' and scales' shapes, nothing computed
    return model_shape(model)


def time_transformers(hf, prompts, new_tokens: int) -> float:
    ids = torch.tensor(prompts, device="cuda")

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(8)
    return (run(new_tokens + 1) - run(1)) / new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.1-8b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--chunks", nargs="+", type=int, default=[1, 4, 8, 16], help="K values timed at batch 1")
    parser.add_argument("--k", type=int, default=8, help="K of the batch rows (graphs, eager, A/B)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=512,
                        help="engine max_num_seqs: graphs are captured for every bucket up to it (capture time is recorded)")
    parser.add_argument("--overlap-ab", action="store_true",
                        help="also time the graph rows with overlap_rounds off (the host reads each round before the next)")
    parser.add_argument("--gemv-ab", action="store_true",
                        help="also time each batch our projection kernels take (GEMV, skinny GEMM; bf16 and FP8) "
                             "with cuBLAS / torch._scaled_mm instead")
    parser.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                        help="the engine rows with prefix caching on, off, or both (the engine built twice)")
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script (float32, no graphs, no roofline)")
    parser.add_argument("--quantization", nargs="+", choices=["none", "fp8"], default=["none"],
                        help="weights of the engine rows: none (the model dtype) and/or fp8; each model is "
                             "timed once per setting (transformers: none only)")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager rows (graph rows only)")
    parser.add_argument("--tp", type=int, default=1,
                        help="also time the graph rows over this many GPUs (tensor parallelism), against one GPU")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/decode_latency.json"))
    parser.add_argument("--pdl", choices=["on", "off"], default="on",
                        help="programmatic dependent launch of the Triton kernels (kernels/launch_settings.py)")
    parser.add_argument("--load-format", choices=["safetensors", "dummy"], default="safetensors",
                        help="dummy: random weights made on the GPUs, no files (e.g. llama-3.1-70b over --tp 2)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                        help="the engine's share of GPU memory (0.9 for a model that fills most of it)")
    for flag, (module, name, kind, what) in SWITCHES.items():
        parser.add_argument(f"--{flag}", type=int if kind is int else str, default=None,
                            choices=["on", "off"] if kind is bool else None,
                            help=f"override {module}.{name}: {what} (A/B)")
    parser.add_argument("--tp-only", action="store_true",
                        help="only the --tp rows (a model one device cannot hold)")
    args = parser.parse_args()

    import transformers

    from graphserve import LLM
    from graphserve.engine.models import fp8, layers
    from graphserve.kernels import launch_settings

    launch_settings.PDL = args.pdl == "on"
    for flag, (module, name, kind, _) in SWITCHES.items():
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            value = value == "on" if kind is bool else value
            mod = importlib.import_module(module)
            if isinstance(getattr(mod, name), triton.language.constexpr):  # a global a kernel reads
                value = triton.language.constexpr(value)
            setattr(mod, name, value)

    cuda = args.device != "cpu"
    bandwidth = copy_bandwidth()["gb_per_s"] * 1e9 if cuda else None
    rows, captures = [], []
    avg_context = args.prompt_len + args.new_tokens // 2

    def record(model_name, engine_kind, batch, k, timing: EngineTiming, shape, quant, caching=None, ranks=1):
        """shape: the StepShape of the model timed; quant: its weights ("bf16", "fp8"); caching: prefix
        caching (engine rows); ranks: devices the model is sharded over (each reads 1/ranks of the bytes)."""
        step_s, busy_s, idle_s = timing
        tok_s = batch / step_s
        roof = step_bytes(shape, batch, avg_context) / ranks / bandwidth if bandwidth else float("nan")
        rows.append(dict(model=model_name, engine=engine_kind, quantization=quant, batch=batch, decode_chunk=k,
                         ms_per_step=step_s * 1e3, tokens_per_s=tok_s,
                         roofline_fraction=roof / step_s if bandwidth else None,
                         prefix_caching=caching, tensor_parallel_size=ranks,
                         device_busy_us_per_step=None if busy_s is None else busy_s * 1e6,
                         device_idle_us_per_step=None if idle_s is None else idle_s * 1e6))
        if ranks > 1:
            # on CPU the "graphs" rows run eagerly too: the eager row, or that one with --no-eager
            single = next((r["tokens_per_s"] for kind in (["graphs"] if cuda else ["eager", "graphs"])
                           for r in rows if r["model"] == model_name and r["batch"] == batch
                           and r["decode_chunk"] == k and r["tensor_parallel_size"] == 1
                           and r["quantization"] == quant and r["engine"] == kind), None)
            rows[-1]["tp_speedup"] = tok_s / single if single else None
        label = f"{quant} {engine_kind}" + ("" if caching is None else " pc-" + ("on" if caching else "off"))
        print(f"{model_name:14s} {label:25s} B={batch:<3d} K={k if k else '-':<3} "
              f"{step_s * 1e3:8.3f} ms/step {tok_s:10.1f} tok/s  {roof / step_s:6.1%} of roofline"
              + ("" if idle_s is None else f"  device busy {busy_s * 1e6:.1f} idle {idle_s * 1e6:.1f} us/step"),
              flush=True)

    settings = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    quantizations = [None if q == "none" else q for q in dict.fromkeys(args.quantization)]
    # last_of_setting: the last engine of a (model, quantization): the TP and transformers rows follow it
    runs = [(name, quant, caching, i == len(settings) - 1) for name in args.models for quant in quantizations
            for i, caching in enumerate(settings)]
    for name, quant_setting, caching, last_of_setting in runs:
        from random_models import CONFIGS, random_model_config

        if args.load_format == "dummy" and name in CONFIGS:  # config and tokenizer only: random weights
            path = str(random_model_config(name))
        else:  # a random_models config, "default" (None: the embedded model) or a folder
            path = resolve_model(name)
        gen = torch.Generator().manual_seed(0)

        def fresh(batch):
            return lambda: torch.randint(100, 30000, (batch, args.prompt_len), generator=gen).tolist()

        max_batch = max(args.batches)
        started = time.perf_counter()
        tp_engine = dict(dtype="bfloat16" if cuda else "float32", max_num_seqs=max(max_batch, args.max_num_seqs),
                         decode_chunk=max(args.k, *args.chunks),
                         max_model_len=args.prompt_len + args.new_tokens + 64, max_num_batched_tokens=8192,
                         gpu_memory_utilization=args.gpu_memory_utilization, prefix_caching=caching,
                         quantization=quant_setting, load_format=args.load_format)

        def single_device():
            """The one-device engine's rows; returns the model's StepShape."""
            llm = LLM(path and str(path), device=args.device, **tp_engine)
            engine = llm.engine.core
            graphs = engine.worker.graphs
            # a checkpoint's own quantization (gpt-oss's MXFP4 experts) where none was asked for
            quant = quantization_label(quant_setting or engine.worker.model.args.quantization, engine.worker.dtype)
            if engine.worker.graphs is None:  # CPU
                captures.append(dict(model=name, quantization=quant, prefix_caching=caching,
                                     engine_start_s=time.perf_counter() - started))
            else:
                captures.append(dict(model=name, quantization=quant, prefix_caching=caching,
                                     engine_start_s=time.perf_counter() - started,
                                     buckets=len(engine.worker.graphs.buckets), largest_bucket=engine.worker.graphs.max_bucket,
                                     capture_s=engine.worker.graphs.capture_seconds, capture_gib=engine.worker.graphs.capture_gib))
                print(f"{name} ({quant}): engine start {captures[-1]['engine_start_s']:.1f}s, of which capturing "
                      f"{len(engine.worker.graphs.graphs)} CUDA graphs (buckets up to {engine.worker.graphs.max_bucket}) "
                      f"{engine.worker.graphs.capture_seconds:.1f}s, {engine.worker.graphs.capture_gib:.2f} GiB", flush=True)
            shape = model_shape(engine.worker.model)
            for batch in args.batches:
                prompts = fresh(batch)
                engine.config.decode_chunk = args.k
                record(name, "graphs", batch, args.k, time_engine(llm, prompts, args.new_tokens), shape, quant, caching)
                if args.overlap_ab:
                    engine.config.overlap_rounds = False
                    record(name, "graphs-no-overlap", batch, args.k, time_engine(llm, prompts, args.new_tokens), shape,
                           quant, caching)
                    engine.config.overlap_rounds = True
                if not args.no_eager:
                    engine.worker.graphs = None
                    record(name, "eager", batch, args.k, time_engine(llm, prompts, args.new_tokens, repeats=1), shape,
                           quant, caching)
                    engine.worker.graphs = graphs
                ours = ((layers, "GEMV_MAX_ROWS"), (layers, "SKINNY_GEMM_MAX_ROWS"), (layers, "FP8_GEMV_MAX_ROWS"),
                        (layers, "FP8_GATE_UP_GEMV_MAX_ROWS"),
                        (fp8, "FP8_GEMM_MAX_ROWS"))  # every projection kernel of ours, bf16 and FP8
                if args.gemv_ab and batch <= max(getattr(m, k) for m, k in ours):
                    saved = [getattr(m, k) for m, k in ours]
                    for m, k in ours:
                        setattr(m, k, 0)
                    graphs.capture(progress=False)  # the projection kernels are chosen when a graph is captured
                    record(name, "graphs-cublas", batch, args.k, time_engine(llm, prompts, args.new_tokens), shape,
                           quant, caching)
                    for (m, k), v in zip(ours, saved):
                        setattr(m, k, v)
                    graphs.capture(progress=False)
            prompts = fresh(1)
            for k in args.chunks:
                engine.config.decode_chunk = k
                record(name, "graphs", 1, k, time_engine(llm, prompts, args.new_tokens), shape, quant, caching)
            stats = engine.stats()
            del llm, engine, graphs
            gc.collect()
            torch.cuda.empty_cache()
            print(f"{name} ({quant}): graph replays per bucket {stats.graph_replays}, eager rounds "
                  f"{stats.eager_rounds}")
            return shape

        quant = quantization_label(quant_setting, torch.bfloat16 if cuda else torch.float32)
        shape = meta_shape(path, quant_setting) if args.tp_only else single_device()
        if args.tp > 1 and last_of_setting:
            steps = time_tensor_parallel(args.tp, path and str(path), args.device, args.batches, args.k,
                                         args.prompt_len, args.new_tokens, tp_engine)
            for batch, step_s in steps.items():
                record(name, f"graphs-tp{args.tp}" if cuda else f"eager-tp{args.tp}", batch, args.k,
                       EngineTiming(step_s), shape, quant, ranks=args.tp)
                print(f"{'':14s} tensor parallel x{args.tp}: {rows[-1]['tp_speedup'] or float('nan'):.2f}x the "
                      f"one-device tok/s", flush=True)
        if not args.skip_transformers and last_of_setting and quant_setting is None:  # bf16 only
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda").eval()
            for batch in args.batches:
                prompts = torch.randint(100, 30000, (batch, args.prompt_len), generator=gen).tolist()
                record(name, "transformers", batch, None, EngineTiming(time_transformers(hf, prompts, args.new_tokens)),
                       shape, "bf16")
            del hf
            gc.collect()
            torch.cuda.empty_cache()

    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s" if bandwidth else "copy bandwidth: not measured (CPU)")
    info = run_info("decode_latency") if cuda else provenance("decode_latency")
    write_json(args.out, dict(**info, copy_bandwidth_gb_s=bandwidth / 1e9 if bandwidth else None,
                              prompt_len=args.prompt_len, new_tokens=args.new_tokens, tensor_parallel_size=args.tp,
                              decode_chunk=args.k, pdl=args.pdl == "on",
                              quantizations=list(dict.fromkeys(c["quantization"] for c in captures)),
                              rows=rows,
                              graph_capture=captures))


if __name__ == "__main__":
    main()
