"""Warm-up before ready: a burst of dummy requests through the engine's own scheduler, runner and
sampler, so that what a first burst of clients would compile, allocate or load (Triton variants,
cuBLAS kernels loaded on first use, the caching allocator's pools, grammar matchers) is done before
the server says ready; on a CPU, where nothing compiles, the grammar vocabulary and each path's
first call. Then the engine forgets the burst: its prefix-cache entries and its counters.

The burst mirrors a first level of traffic: prompts of every size class up to the prefill token
budget and past it (chunked), a prefix-cache hit, decode rounds as the batch grows and shrinks, and
each sampling variant (greedy, top-k/top-p, penalties, logprobs, seeded, grammar-masked). It is
deterministic (fixed prompts and seeds, no grammar under tensor parallelism), so every rank of a
tensor-parallel engine runs the same steps with the same collectives."""

from __future__ import annotations

import logging
import time

from graphserve.engine.request import SamplingParams
from graphserve.engine.structured.grammar import JSON_OBJECT_SCHEMA, GrammarSpec

logger = logging.getLogger("graphserve.engine")

# sampling variants, taken in turn by the burst's requests
VARIANTS = (
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9, top_k=40, min_p=0.05),
    dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    dict(temperature=0.0, logprobs=5),
    dict(temperature=1.0, logit_bias={0: -1.0}),
)


def prompt_lengths(max_prompt: int, budget: int, on_gpu: bool) -> list[int]:
    """Prompt sizes of the burst: 1, around the block sizes, then doubling to the prefill token
    budget and past it (a chunked prefill); on CPU only short ones (the CPU has no kernels to compile)."""
    if not on_gpu:
        return [n for n in (1, 17, 40) if n <= max_prompt]
    lengths = [1, 7, 15, 16, 17, 31, 33, 100, 129, 257, 513, 1000]
    n = 2048
    while n <= 2 * budget:
        lengths.append(n)
        n *= 2
    lengths.append(budget + 100)  # past the budget: chunked
    return sorted({min(n, max_prompt) for n in lengths if n >= 1})


def burst(max_model_len: int, max_num_seqs: int, budget: int, decode_chunk: int, vocab_size: int, on_gpu: bool,
          grammar: bool) -> tuple[list[tuple[list[int], SamplingParams]], tuple[list[int], SamplingParams]]:
    """The warm-up burst: its first wave of (prompt token ids, params), and a request to send after
    it, which repeats a prompt of the wave (a prefix-cache hit)."""
    max_tokens = max(1, min(2 * decode_chunk + 1, max_model_len - 2))  # rounds of K steps, and a last short one
    max_prompt = max(1, max_model_len - max_tokens - 1)
    lengths = prompt_lengths(max_prompt, budget, on_gpu)
    # on the GPU, enough requests to fill the decode batch up to a typical burst's (64)
    count = max(len(lengths), min(max_num_seqs, 64)) if on_gpu else len(lengths)
    wave = []
    for i in range(count):
        n = lengths[i % len(lengths)]
        prompt = [(7 + 31 * i + 13 * j) % vocab_size for j in range(n)]
        wave.append((prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                                            **VARIANTS[i % len(VARIANTS)])))
    if grammar:
        wave.append(([1, 2, 3][:max_prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                               grammar=GrammarSpec("json_schema", JSON_OBJECT_SCHEMA))))
    longest = max((p for p, _ in wave if len(p) <= budget), key=len)
    return wave, (list(longest), SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))


def warm_up(core, timeout: float = 300.0) -> float:
    """Run the burst on `core` (an EngineCore with nothing running) and forget it; returns its seconds."""
    started = time.perf_counter()
    cfg = core.config
    wave, repeat = burst(core.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.decode_chunk,
                         core.args.vocab_size, core.device.type == "cuda",
                         grammar=core.tp.size == 1)
    for i, (prompt, params) in enumerate(wave):
        core.add_sequence(core.make_sequence(f"warm-up-{i}", prompt, params))
    _drain(core, started + timeout)
    core.add_sequence(core.make_sequence("warm-up-hit", *repeat))
    _drain(core, started + timeout)
    core.sequences.clear()
    core.block_manager.forget_cached_blocks()
    core.reset_stats()
    seconds = time.perf_counter() - started
    logger.info("warmed up in %.1fs: %d requests, prompts of 1 to %d tokens", seconds, len(wave) + 1,
                max(len(p) for p, _ in wave))
    return seconds


def _drain(core, deadline: float) -> None:
    while core.has_unfinished():
        core.step()
        if time.perf_counter() > deadline:
            raise TimeoutError("the warm-up burst did not finish in time")
