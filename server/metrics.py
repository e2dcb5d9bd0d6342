"""Prometheus metrics: request/token counters and latency histograms recorded by the
server, plus engine gauges read from `engine.stats()` at scrape time.

Each app owns its CollectorRegistry, so several apps can live in one process (tests).
With several front-end processes (PROMETHEUS_MULTIPROC_DIR set by the supervisor), each
one's counters live in shared files and /metrics on any of them adds them all up; the
engine's figures come from the one core, so every front end reports the same.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("graphserve.server")

PREFIX = "graphserve"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 40.0, 160.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Counters and histograms the HTTP layer updates as requests finish."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Finished generation requests (one per choice), by finish reason.",
            ["finish_reason"],
            registry=self.registry,
        )
        self.http_errors = Counter(
            f"{PREFIX}_request_errors",
            "Requests answered with an error, by HTTP status.",
            ["status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens of finished requests.", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Time from request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request.",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        # the time to first token in three parts, which add up to it
        self.queue_time = Histogram(
            f"{PREFIX}_request_queue_time_seconds",
            "From a request's arrival (parsed) to the prefill step that first takes it: the hop to the "
            "engine core, the core finishing the step it is in, and waiting for a sequence slot or KV blocks.",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.prefill_time = Histogram(
            f"{PREFIX}_request_prefill_time_seconds",
            "From the prefill step that first takes a request to its first token on the engine's host "
            "(its prefill steps, and the work queued on the device before them).",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.first_token_return = Histogram(
            f"{PREFIX}_request_first_token_return_seconds",
            "From a request's first token on the engine's host to the front end: the rest of that step "
            "(waiting for a decode round in flight), the hop back, detokenizing.",
            buckets=_PHASE_BUCKETS,
            registry=self.registry,
        )
        self.lora_requests = Counter(
            f"{PREFIX}_lora_requests",
            "Finished generation requests (one per choice) that ran with a LoRA adapter, by adapter.",
            ["lora_name"],
            registry=self.registry,
        )
        self.engine_collector = EngineStatsCollector(engine)
        self.registry.register(self.engine_collector)

    def observe_finished(
        self,
        *,
        finish_reason: str | None,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        arrival_time: float,
        first_token_time: float | None,
        finish_time: float,
        core_times: tuple[float, float] | None = None,
        lora_name: str | None = None,
    ) -> None:
        """core_times: (first scheduled, first token on the engine's host) on time.monotonic(), which
        is CLOCK_MONOTONIC: one clock for the front ends and the engine core. lora_name: the request's
        LoRA adapter."""
        self.requests.labels(finish_reason=finish_reason or "abort").inc()
        if lora_name is not None:
            self.lora_requests.labels(lora_name=lora_name).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        self.e2e_latency.observe(finish_time - arrival_time)
        if first_token_time is not None:
            self.time_to_first_token.observe(first_token_time - arrival_time)
            if num_generated_tokens > 1:
                self.time_per_output_token.observe((finish_time - first_token_time) / (num_generated_tokens - 1))
            if core_times is not None:
                scheduled, first_token = core_times
                self.queue_time.observe(scheduled - arrival_time)
                self.prefill_time.observe(first_token - scheduled)
                self.first_token_return.observe(first_token_time - first_token)

    def observe_error(self, status_code: int) -> None:
        self.http_errors.labels(status=str(status_code)).inc()

    def render(self) -> bytes:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every front end's counters, from their shared files
        multiprocess.MultiProcessCollector(registry)
        registry.register(self.engine_collector)
        return generate_latest(registry)


class EngineStatsCollector(Collector):
    """Reads the engine's counters when Prometheus scrapes, so nothing runs per token."""

    def __init__(self, engine: Any):
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # metric names depend on the stats; skip the registry's name-collision check

    def collect(self) -> Iterator[Metric]:
        if not getattr(self.engine, "ready", False):
            return
        try:
            stats = self.engine.stats()
        except Exception:  # a scrape must never fail because the engine is busy or gone
            logger.debug("engine.stats() failed during a scrape", exc_info=True)
            return
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_running", "Requests in the running batch.", stats.num_running)
        yield GaugeMetricFamily(
            f"{PREFIX}_num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting
        )
        yield GaugeMetricFamily(f"{PREFIX}_kv_blocks_total", "KV-cache blocks in the pool.", stats.kv_blocks_total)
        yield GaugeMetricFamily(f"{PREFIX}_kv_blocks_free", "Free KV-cache blocks.", stats.kv_blocks_free)
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_blocks_cached_free",
            "Free KV-cache blocks that still hold a cached prefix (counted as free; evicted LRU when needed).",
            stats.kv_blocks_cached_free,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield CounterMetricFamily(
            f"{PREFIX}_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.", stats.prefix_cache_hits
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_grammar_requests",
            "Requests holding a grammar matcher (response_format, tools) or waiting for their grammar to compile.",
            stats.grammar_requests,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_blocks_used",
            "KV-cache blocks owned by requests.",
            stats.kv_blocks_total - stats.kv_blocks_free,
        )
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0 to 1; with KV cache groups, the fullest group's).",
                                stats.kv_cache_usage)
        # the KV cache's layout as labels, as vLLM's cache_config_info: the Gateway API Inference Extension's
        # endpoint picker sizes its prefix-cache model from block_size and num_gpu_blocks (deploy/): the blocks of
        # context the cache holds, the full-attention group's where windowed layers keep a pool of their own
        layout = GaugeMetricFamily(f"{PREFIX}_cache_config_info", "The KV cache's layout (the labels); always 1.",
                                   labels=["block_size", "num_gpu_blocks"])
        layout.add_metric([str(self.engine.info.block_size), str(stats.kv_context_blocks)], 1.0)
        yield layout
        yield CounterMetricFamily(
            f"{PREFIX}_num_preemptions", "Sequences preempted for lack of KV blocks.", stats.num_preemptions
        )
        yield CounterMetricFamily(
            f"{PREFIX}_decode_rounds", "Decode rounds run (each up to K steps).", stats.decode_rounds
        )
        yield CounterMetricFamily(
            f"{PREFIX}_decode_rounds_ahead", "Decode rounds launched before the previous one was read.",
            stats.decode_rounds_ahead,
        )
        yield CounterMetricFamily(f"{PREFIX}_prefill_steps", "Prefill batches run.", stats.prefill_steps)
        yield CounterMetricFamily(f"{PREFIX}_prefill_graph_steps", "Prefill batches run by replaying a CUDA graph.",
                                  stats.prefill_graph_steps)
        yield CounterMetricFamily(f"{PREFIX}_prefill_steps_ahead",
                                  "Prefill graphs run ahead of the decode rounds queued on the device.",
                                  stats.prefill_steps_ahead)
        yield CounterMetricFamily(
            f"{PREFIX}_device_busy_seconds", "Time the device spent running prefill batches and decode rounds.",
            stats.device_busy_seconds,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_device_idle_seconds",
            "Time the device waited for the host between batches while requests were running.",
            stats.device_idle_seconds,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_core_gc_full_collections",
            "Full garbage collections in the engine-core process (each stops its loop).",
            stats.gc_full_collections,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_core_gc_full_collection_seconds",
            "Time the engine-core process spent in full garbage collections.",
            stats.gc_full_collection_seconds,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_spec_verify_rows",
            "Speculative decoding: sequences verified with at least one draft, one per sequence and verify step "
            "(mean accepted length = 1 + accepted tokens / verify rows).",
            stats.spec_verify_rows,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_spec_draft_tokens", "Speculative decoding: draft tokens verified.", stats.spec_draft_tokens
        )
        yield CounterMetricFamily(
            f"{PREFIX}_spec_accepted_tokens", "Speculative decoding: draft tokens accepted.", stats.spec_accepted_tokens
        )
        replays = CounterMetricFamily(
            f"{PREFIX}_cuda_graph_replays",
            "Decode steps replayed from a CUDA graph, by batch bucket.",
            labels=["bucket"],
        )
        for bucket, count in sorted(stats.graph_replays.items()):
            replays.add_metric([str(bucket)], count)
        yield replays
        eager = CounterMetricFamily(
            f"{PREFIX}_eager_decode_rounds", "Decode rounds run eagerly (no graph), by reason.", labels=["reason"]
        )
        for reason, count in sorted(stats.eager_rounds.items()):
            eager.add_metric([reason], count)
        yield eager
        if stats.max_loras:
            yield lora_info(stats.max_loras, stats.lora_running, stats.lora_waiting, stats.lora_updated_at)


LORA_INFO_METRIC = f"{PREFIX}_lora_requests_info"


def lora_info(max_loras: int, running: list[str], waiting: list[str], updated_at: float) -> GaugeMetricFamily:
    """The Gateway API Inference Extension's LoRA gauge in vLLM's form (vllm:lora_requests_info): labels
    max_lora, running_lora_adapters and waiting_lora_adapters (comma-separated names), value the time
    (Unix seconds) they last changed. The endpoint picker reads it with
    --lora-info-metric=graphserve_lora_requests_info (docs/lora.md)."""
    family = GaugeMetricFamily(LORA_INFO_METRIC, "LoRA adapters of running and waiting requests, the most the "
                               "device holds at once (max_lora); the value is when they last changed.",
                               labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    family.add_metric([str(max_loras), ",".join(running), ",".join(waiting)], updated_at)
    return family
