"""How a model's layers split over tensor-parallel ranks: which heads, KV heads, MLP columns and
vocabulary rows each rank holds, and a clear error for a size the model cannot take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from graphserve.engine.distributed import TensorParallel
from graphserve.engine.errors import InvalidConfigError
from graphserve.engine.models.config import ModelArgs
from graphserve.kernels.mxfp4 import GROUP


def check_tensor_parallel(args: ModelArgs, size: int, device: torch.device) -> None:
    """A clear error for a tensor-parallel size this model or machine cannot take."""
    if size < 1:
        raise InvalidConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    if args.moe is not None and device.type != "cpu":
        raise InvalidConfigError(f"tensor_parallel_size {size}: mixture-of-experts models ({args.architecture}) "
                                 "are sharded over CPU ranks only for now; on CUDA they run on one GPU")
    if args.moe is not None:
        _check_intermediate(args, args.moe.expert_intermediate_size, size)
    if device.type == "cuda" and size > torch.cuda.device_count():
        raise InvalidConfigError(f"tensor_parallel_size {size} exceeds the {torch.cuda.device_count()} visible GPUs")
    if args.num_heads % size:
        raise InvalidConfigError(f"tensor_parallel_size {size} does not divide the model's {args.num_heads} "
                                 "attention heads (num_attention_heads)")
    if args.num_kv_heads % size and size % args.num_kv_heads:
        raise InvalidConfigError(f"tensor_parallel_size {size} neither divides nor is a multiple of the model's "
                                 f"{args.num_kv_heads} KV heads (num_key_value_heads)")
    if args.moe is None:
        _check_intermediate(args, args.intermediate_size, size)


def _check_intermediate(args: ModelArgs, inter: int, size: int) -> None:
    """The MLP's (each expert's) intermediate columns split evenly, and MXFP4 experts' in whole blocks."""
    field = "moe_intermediate_size" if args.architecture == "Qwen3MoeForCausalLM" else "intermediate_size"
    kind = "expert intermediate size" if args.moe is not None else "intermediate size"
    if inter % size:
        raise InvalidConfigError(f"tensor_parallel_size {size} does not divide the model's {kind} {inter} ({field})")
    if args.quantization == "mxfp4" and inter // size % GROUP:
        raise InvalidConfigError(f"tensor_parallel_size {size}: {field} {inter} leaves each rank {inter // size} "
                                 f"columns of every expert, not whole MXFP4 blocks: a rank's share must be a multiple "
                                 f"of {GROUP} values")


@dataclass(frozen=True)
class Shard:
    """This rank's part of the model: its heads, KV heads, MLP columns and vocabulary rows."""

    whole: ModelArgs  # the whole model's shapes (where a checkpoint's fused tensor puts each part)
    local: ModelArgs  # the shapes this rank's layers have (heads, KV heads, intermediate size)
    q_heads: tuple[int, int]  # [start, end) of the query heads
    kv_heads: tuple[int, int]  # [start, end) of the KV heads (one replicated head when they are fewer than ranks)
    inter: tuple[int, int]  # [start, end) of the MLP's intermediate columns (each expert's, in an MoE model)
    vocab: tuple[int, int]  # [start, end) of the vocabulary rows (end - start <= vocab_rows)
    vocab_rows: int  # rows of the local embedding / LM head (the last rank's padded with zeros)
    # the row-parallel projections' biases (gpt-oss's o_proj and experts' down) are added before the all-reduce
    # sums the ranks' outputs: rank 0 holds them, the others zeros, so each is added once
    holds_row_biases: bool


def shard_for(args: ModelArgs, tp: TensorParallel) -> Shard:
    n, r = tp.size, tp.rank
    hq = args.num_heads // n
    if args.num_kv_heads >= n:
        hkv = args.num_kv_heads // n
        kv = (r * hkv, (r + 1) * hkv)
    else:
        hkv = 1
        head = r * args.num_kv_heads // n
        kv = (head, head + 1)
    moe = args.moe
    if moe is not None:  # each expert's SwiGLU split by its intermediate columns, as the dense MLP's
        inter = moe.expert_intermediate_size // n
        moe = dataclasses.replace(moe, expert_intermediate_size=inter)
    else:
        inter = args.intermediate_size // n
    rows = -(-args.vocab_size // n)
    vocab = (min(r * rows, args.vocab_size), min((r + 1) * rows, args.vocab_size))
    local = dataclasses.replace(args, num_heads=hq, num_kv_heads=hkv, moe=moe,
                                intermediate_size=inter if args.moe is None else args.intermediate_size)
    return Shard(args, local, (r * hq, (r + 1) * hq), kv, (r * inter, (r + 1) * inter), vocab, rows, r == 0)
