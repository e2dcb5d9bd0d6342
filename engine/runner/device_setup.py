"""What a rank's device state is built from: device, host threads, tensor parallelism, dtype, KV pool size.

Pure decisions from the engine config, the model's files and the device, taken once by the Worker
(engine/runner/worker.py) before it loads anything or allocates the KV pool."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from graphserve.engine.config import EngineConfig
from graphserve.engine.cpu import paths as cpu_paths
from graphserve.engine.cpu import quant_linear
from graphserve.engine.distributed import TensorParallel, init_tensor_parallel
from graphserve.engine.errors import InvalidConfigError
from graphserve.engine.models.config import ModelArgs
from graphserve.engine.models.sharding import check_tensor_parallel
from graphserve.engine.sched.kv_cache import kv_bytes_per_block
from graphserve.engine.sched.kv_groups import KVLayout

logger = logging.getLogger("graphserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device cuda was asked for, but no CUDA GPU is available")
    return torch.device(name)


def resolve_dtype(name: str, args: ModelArgs, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(args.dtype, torch.bfloat16) if args.dtype != "float32" else torch.bfloat16


def resolve_quantization(config: EngineConfig, model_path: str, device: torch.device) -> str | None:
    """The quantization asked for; left out, "gguf" for a GGUF model (the embedded default, --model
    FILE.gguf, or the folder it was converted into) on the CPU with dtype auto and one rank: the
    file's quantized blocks, as it ships them, where the quantized kernel is built. --dtype float32
    serves the dequantized weights instead (exactly transformers' tokens)."""
    if config.quantization is not None or config.dtype != "auto" or device.type != "cpu" \
            or config.tensor_parallel_size != 1:
        return config.quantization
    if not (Path(model_path) / quant_linear.GGUF_BLOCKS_FILE).is_file() or not quant_linear.available():
        return None
    logger.info("serving the GGUF file's quantized blocks (--dtype float32: its dequantized float32 weights)")
    return "gguf"


def cpu_has_native_bf16() -> bool:
    """x86: AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (elsewhere: assume yes, say nothing)."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags or "flags" not in flags


def set_up_host(config: EngineConfig, device: torch.device) -> None:
    """The host's threads and, on the CPU backend, the instruction sets asked for (checked, logged)."""
    if device.type == "cpu":
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        try:
            cpu_paths.check_requested_isa()
        except ValueError as exc:
            raise InvalidConfigError(str(exc)) from None
        logger.info(cpu_paths.describe())
    else:  # the host's share of a GPU round is tiny; idle OpenMP workers would spin on the front ends' cores
        torch.set_num_threads(1)


def warn_if_emulated(dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cpu" and dtype != torch.float32 and not cpu_has_native_bf16():
        logger.warning("%s on a CPU without native bf16/fp16 matrix instructions is emulated and several "
                       "times slower than float32 (measured 4x); prefer --dtype float32",
                       str(dtype).split(".")[-1])


def join_tensor_parallel(config: EngineConfig, args: ModelArgs, device: torch.device, tp_rank: int,
                         tp_init_method: str | None) -> tuple[torch.device, TensorParallel]:
    """This rank's device (under tensor parallelism on CUDA, GPU tp_rank) and its group of ranks,
    the model's shapes checked against the split."""
    tp_size = config.tensor_parallel_size
    check_tensor_parallel(args, tp_size, device)
    if tp_size > 1 and tp_init_method is None:
        raise InvalidConfigError("tensor_parallel_size > 1 needs every rank started with its rank and the "
                                 "ranks' rendezvous (tp_rank, tp_init_method)")
    if device.type == "cuda" and tp_size > 1:
        device = torch.device("cuda", tp_rank)
    return device, init_tensor_parallel(tp_rank, tp_size, device, tp_init_method or "")


def num_kv_blocks(config: EngineConfig, args: ModelArgs, kv_args, dtype: torch.dtype, device: torch.device,
                  draft_kv_args=None, layout: KVLayout | None = None) -> int:
    """The KV pool's blocks (with several KV cache groups, group 0's: `layout`): config.num_kv_blocks,
    else what the device's memory (CUDA) or kv_cache_bytes (CPU) holds, a draft model's blocks of the
    same count included (kv_args: the models' KV shapes), the windowed groups' bounded pools
    (KVLayout.pool_blocks) too, at most what every sequence at full length needs."""
    cfg = config
    if cfg.num_kv_blocks:
        return cfg.num_kv_blocks
    per_block = kv_bytes_per_block(kv_args, cfg.block_size, dtype)
    if draft_kv_args is not None:
        per_block += kv_bytes_per_block(draft_kv_args, cfg.block_size, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what loading freed (a draft model's too) is free for the pool
        free, total = torch.cuda.mem_get_info(device)
        # leave room for activations, logits and CUDA graphs
        reserve = 2 * 1024**3 + cfg.max_num_batched_tokens * args.vocab_size * 8
        budget = free - (1 - cfg.gpu_memory_utilization) * total - reserve
    else:
        budget = cfg.kv_cache_bytes
    max_len = cfg.max_model_len or args.max_position_embeddings
    # no more than every sequence at full length needs, plus the dummy block
    cap = cfg.max_num_seqs * -(-max_len // cfg.block_size) + 1
    if layout is None or layout.num_groups == 1:
        return max(2, min(int(budget // per_block), cap))
    # group 0's pool: the most whose groups' pools together fit the budget (they grow with it; no draft model)
    layer_block = kv_bytes_per_block(kv_args, cfg.block_size, dtype) // kv_args.num_layers
    low, high = 2, max(2, cap)
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if layout.bytes_for(mid, cfg, layer_block) <= budget else (low, mid - 1)
    return low
