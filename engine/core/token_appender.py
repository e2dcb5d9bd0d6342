"""TokenAppender: what a step's tokens do to their requests: appended, ended where they stop, made outputs.

It appends each sequence's new tokens up to its end (a grammar's end or rejection, EOS, a stop token
id, max_tokens), drops the tokens after it, ends the finished sequences (their blocks freed, their
grammar matchers and drafter state released) and makes the CoreOutputs the front ends get. Text,
detokenizing and stop strings belong to the front end."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from graphserve.engine.core.messages import CoreOutput
from graphserve.engine.request import Sequence, TokenLogprob
from graphserve.engine.runner.model_runner import StepTokens
from graphserve.engine.sched.kv_groups import KVGroups
from graphserve.engine.sched.scheduler import DecodeRound, PrefillBatch, Scheduler
from graphserve.engine.spec.speculative_decoder import SpeculativeDecoder
from graphserve.engine.stats import EngineStats
from graphserve.engine.structured.matchers import StructuredOutputs

logger = logging.getLogger("graphserve.engine")


class TokenAppender:
    def __init__(self, sequences: dict[str, Sequence], scheduler: Scheduler, block_manager: KVGroups,
                 structured: StructuredOutputs, speculation: SpeculativeDecoder | None, eos_ids: tuple[int, ...]):
        """sequences: the engine's running requests by id (shared: the ones that end leave it)."""
        self.sequences = sequences
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.structured = structured
        self.speculation = speculation
        self.eos_ids = eos_ids

    def process(self, batch: PrefillBatch | DecodeRound, new_tokens: dict[str, StepTokens],
                stats: EngineStats) -> list[CoreOutput]:
        """Append a batch's tokens, end the sequences that are done, and make their outputs
        (counted in `stats`)."""
        if isinstance(batch, PrefillBatch):
            stats.prefill_steps += 1
            stats.prompt_tokens += sum(batch.chunk_lens[:len(batch.chunk_lens) - batch.num_decodes])
            for seq in batch.seqs:  # requests admitted from now on can share these blocks already
                self.block_manager.register(seq)
            touched = [s for s in batch.seqs if not s.in_prefill]
        else:
            stats.decode_rounds += 1
            # a sequence that ended (stop, abort) while its round was in flight: its tokens are dropped
            touched = [s for s in batch.seqs if not s.is_finished]
        outputs = []
        for seq in touched:
            step = new_tokens.get(seq.request_id)
            first = seq.num_output_tokens == 0
            if step is not None:
                kept = self.append(seq, step)
                stats.generation_tokens += kept
                if not seq.is_finished and isinstance(batch, DecodeRound):
                    seq.num_computed_tokens = seq.num_tokens - 1
                out = CoreOutput(seq.request_id, step.tokens[:kept], finish_reason=seq.finish_reason,
                                 stop_reason=seq.stop_reason, error=seq.error, request_at_fault=seq.error is not None)
                if step.logprobs is not None:
                    out.logprobs = [TokenLogprob(t, lp, top)
                                    for t, lp, top in zip(step.tokens[:kept], step.logprobs, step.top)]
            else:
                if seq.num_tokens_left <= 0:  # max_tokens 0: prompt logprobs only
                    seq.finish_reason = "length"
                out = CoreOutput(seq.request_id, [], finish_reason=seq.finish_reason)
            if first:
                out.num_cached_tokens = seq.num_cached_tokens
                if out.token_ids:
                    now = time.monotonic()
                    out.core_times = (seq.scheduled_at or now, now)
                if seq.prompt_logprobs is not None:
                    out.prompt_logprobs = seq.prompt_logprobs
            if seq.finish_reason is not None:
                self.finish(seq)
            outputs.append(out)
        return outputs

    def append(self, seq: Sequence, step: StepTokens) -> int:
        """Append `step.tokens` to `seq` up to its end (EOS, a stop token id, max_tokens);
        returns how many were kept."""
        params = seq.params
        eos = () if params.ignore_eos else self.eos_ids
        kept = 0
        for token in step.tokens:
            if params.grammar is not None:
                accepted, grammar_done = self.structured.accept(seq.request_id, token)
                if not accepted:
                    seq.finish_reason = "error"
                    if self.structured.allows_nothing(seq.request_id):
                        # the grammar needs bytes no token of this vocabulary spells (a character whose
                        # lead byte it lacks): the row was masked whole and the sampler fell on id 0
                        seq.error = ("the output's constraint asks for text this model's vocabulary cannot write "
                                     "(no token can continue it)")
                    else:  # the mask allowed it: only a bug gets here
                        logger.error("request %s: the grammar rejected sampled token %d", seq.request_id, token)
                    break
                if grammar_done:  # the grammar accepted an end-of-sequence token
                    seq.token_ids.append(token)
                    kept += 1
                    seq.finish_reason, seq.stop_reason = "stop", None
                    break
            seq.token_ids.append(token)
            kept += 1
            n_out = seq.num_output_tokens
            if (token in eos or token in params.stop_token_ids) and n_out > params.min_tokens:
                seq.finish_reason, seq.stop_reason = "stop", token if token not in self.eos_ids else None
                break
            if seq.num_tokens_left <= 0:
                seq.finish_reason = "length"
                break
        return kept

    def fail(self, seqs: list[Sequence], error: str | None = None,
             on_fail: Callable[[str], None] | None = None) -> list[CoreOutput]:
        """End the unfinished ones of `seqs` with finish_reason "error" (on_fail: told each one's id)."""
        outputs = []
        for seq in seqs:
            if seq.is_finished:
                continue
            self.finish(seq)
            if on_fail is not None:
                on_fail(seq.request_id)
            seq.finish_reason = "error"
            outputs.append(CoreOutput(seq.request_id, [], finish_reason="error", error=error))
        return outputs

    def finish(self, seq: Sequence) -> None:
        """A request ended: its blocks, its grammar matcher and its drafter state go."""
        self.scheduler.finish(seq)
        self.sequences.pop(seq.request_id, None)
        self.structured.release(seq.request_id)
        if self.speculation is not None:
            self.speculation.release(seq.request_id)
