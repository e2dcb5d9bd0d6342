"""EngineStats: the engine core's counters, read by /metrics (sent to the front ends)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0  # over every KV cache group (engine/sched/kv_groups.py)
    kv_blocks_free: int = 0  # truly free plus cached-free
    kv_context_blocks: int = 0  # the full-attention group's: blocks of context the cache holds
    kv_cache_usage: float = 0.0  # the fullest group's share of blocks owned by requests, 0 to 1
    kv_blocks_cached_free: int = 0  # no user, but holding a cached prefix (evicted LRU when needed)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found there
    num_preemptions: int = 0
    grammar_requests: int = 0  # requests holding a grammar matcher or waiting for their grammar to compile
    decode_rounds: int = 0
    decode_rounds_ahead: int = 0  # rounds launched before the previous round's tokens were read
    prefill_steps: int = 0
    prefill_graph_steps: int = 0  # of them, replayed as a CUDA graph (engine/runner/prefill_graphs.py)
    prefill_steps_ahead: int = 0  # of those, run ahead of the decode rounds queued on the device
    prompt_tokens: int = 0
    generation_tokens: int = 0
    graph_replays: dict[int, int] = field(default_factory=dict)  # batch bucket -> decode steps replayed
    eager_rounds: dict[str, int] = field(default_factory=dict)  # reason -> decode rounds run eagerly
    # speculative decoding (engine/spec/speculative_decoder.py): mean accepted length = 1 + accepted / verify rows
    spec_verify_rows: int = 0  # sequences verified with at least one draft (one per sequence and verify step)
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # of them, accepted
    device_busy_seconds: float = 0.0  # the device ran a batch or round
    device_idle_seconds: float = 0.0  # requests were running, but the device waited for the host
    gc_full_collections: int = 0  # the core process's full garbage collections (engine/gc_stats.py)
    gc_full_collection_seconds: float = 0.0  # the time they took, the core's loop stopped
    # LoRA (0: off): device slots, the adapters of running and of waiting requests (names, sorted), and when
    # those last changed (time.time())
    max_loras: int = 0
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    lora_updated_at: float = 0.0
