"""EngineConfig: every engine knob in one dataclass; the server fills it from configs/*.toml and
CLI flags (server/settings.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

SPECULATIVE_METHODS = ("ngram", "draft")
# GRAPHSERVE_WARM_UP=0: engines skip the warm-up burst unless told to run it (a config file, --warm-up):
# for development and the CPU test suite, whose hundreds of engines time no first burst
WARM_UP_ENV = "GRAPHSERVE_WARM_UP"
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class EngineConfig:
    model: str | None = None  # local HF folder; None = the embedded default model
    device: str = "auto"  # auto | cpu | cuda
    # auto | float32 | bfloat16 | float16 (auto: the checkpoint's on CUDA; float32 on CPU, but a GGUF model's
    # quantized blocks there: runner/device_setup.resolve_quantization)
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the KV pool
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024  # prefill token budget per step
    block_size: int = 16
    decode_chunk: int = 8  # K: decode steps per round between host syncs
    gpu_memory_utilization: float = 0.90
    kv_cache_bytes: int = 512 * 1024**2  # KV pool size on CPU
    num_kv_blocks: int | None = None  # override the budget (tests use tiny pools)
    enforce_eager: bool = False
    prefix_caching: bool = True  # reuse the KV of cached full blocks of a prompt's prefix (kv_cache.py)
    overlap_rounds: bool = True  # launch the next graph decode round before reading the current one's tokens
    cuda_graph_max_batch: int = 512
    cuda_graph_max_prefill_tokens: int = 1024  # prefills of up to this many tokens replay a graph; 0: none
    # such a replay may run ahead of the decode rounds queued on the device, and the core prefills
    # newcomers while it waits for a round (off until its GPU tests have passed again: README)
    prefill_ahead: bool = False
    num_threads: int | None = None  # torch CPU threads; None: all cores
    seed: int | None = None  # seeds of unseeded requests: None draws them from the OS
    grammar_compile_timeout: float = 10.0  # seconds a response_format / tool grammar may take to compile
    tensor_parallel_size: int = 1  # ranks (devices of one host) the model is sharded over (engine/distributed.py)
    # "fp8": projection weights in float8 e4m3 with per-channel scales; "gguf" (CPU, a GGUF model): the
    # projections and LM head kept in the file's quantized blocks (engine/cpu/quant_linear.py)
    quantization: str | None = None
    load_format: str = "safetensors"  # "dummy": random weights, no weight file read (benchmarks of big shapes)
    # before ready, a burst of dummy requests through every path a first burst takes (engine/core/warm_up.py)
    warm_up: bool = field(default_factory=lambda: os.environ.get(WARM_UP_ENV, "1") != "0")
    # speculative decoding (engine/spec/speculative_decoder.py): "ngram" (prompt lookup), "draft" (a smaller model
    # with the target's vocabulary, `draft_model`, engine/spec/draft_model.py) or None (off)
    speculative_method: str | None = None
    draft_model: str | None = None
    draft_quantization: str | None = None  # "fp8": the draft model's projections in FP8; None: the target's setting
    num_speculative_tokens: int = 4  # k: drafts verified per sequence and step
    # decode rounds of more sequences do not speculate (None: the device's default, spec/factory.default_max_batch)
    speculative_max_batch: int | None = None
    # LoRA adapters (engine/lora/): requests pick one by name (the server's --lora-modules); max_loras of them
    # in device slots at once (least recently used out, never one a running request uses), max_cpu_loras
    # cached in host memory (None: max_loras), ranks up to max_lora_rank
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 64

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(unknown)}")
        return cls(**data)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.decode_chunk < 1:
            raise ValueError(f"decode_chunk must be >= 1, got {self.decode_chunk}")
        if self.quantization not in (None, "fp8", "gguf"):
            raise ValueError(f"quantization must be fp8 or gguf (or left out), got {self.quantization!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be safetensors or dummy, got {self.load_format!r}")
        if self.cuda_graph_max_prefill_tokens < 0:
            raise ValueError(f"cuda_graph_max_prefill_tokens must be >= 0, got {self.cuda_graph_max_prefill_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(f"speculative_method must be {' or '.join(SPECULATIVE_METHODS)} (or left out), "
                             f"got {self.speculative_method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                             f"got {self.num_speculative_tokens}")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model (draft_model) goes with speculative_method draft, and that method "
                             "needs one")
        if self.draft_quantization not in (None, "fp8"):
            raise ValueError(f"draft_quantization must be fp8 (or left out: the target's), got {self.draft_quantization!r}")
        if self.draft_quantization is not None and self.draft_model is None:
            raise ValueError("draft_quantization goes with a draft model (draft_model)")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if not 1 <= self.max_loras <= 1024:
            raise ValueError(f"max_loras must be in [1, 1024], got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters do not run under tensor parallelism yet: leave enable_lora off or set "
                             "tensor_parallel_size to 1")
        if self.speculative_method is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative decoding does not run under tensor parallelism yet: "
                             "leave speculative_method out or set tensor_parallel_size to 1")
