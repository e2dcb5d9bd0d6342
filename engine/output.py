"""OutputProcessor: after each step, appends a sequence's new tokens, finds its end
(EOS / stop ids / max_tokens / stop strings, dropping tokens past the end), and turns
ids into text deltas for RequestOutput."""

from __future__ import annotations

import time

from engine.request import RequestOutput, Sequence, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class _TextState:
    def __init__(self, tokenizer: Tokenizer, seq: Sequence):
        self.detok = IncrementalDetokenizer(tokenizer, seq.params.skip_special_tokens)
        self.stops = StopStringMatcher(seq.params.stop, seq.params.include_stop_str_in_output)
        self.text = ""  # everything decoded so far (may run past a stop string)
        self.visible_end = 0  # text[:visible_end] may be shown
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.states: dict[str, _TextState] = {}

    def start(self, seq: Sequence) -> None:
        self.states[seq.request_id] = _TextState(self.tokenizer, seq)

    def append(self, seq: Sequence, step) -> int:
        """Append `step.tokens` to `seq` up to its end; returns how many were kept."""
        state = self.states[seq.request_id]
        params = seq.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_ids)
        kept = 0
        for i, token in enumerate(step.tokens):
            seq.token_ids.append(token)
            kept += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if seq.logprobs is not None:
                seq.logprobs.append(TokenLogprob(token, step.logprobs[i], step.top[i]))
            n_out = seq.num_output_tokens
            if token in stop_ids and n_out > params.min_tokens:
                seq.finish_reason, seq.stop_reason = "stop", token if token not in self.eos_ids else None
            elif n_out >= params.max_tokens:
                seq.finish_reason = "length"
            if state.stops.stops:  # stop strings: decode token by token to know where the text ends
                if self._update_text(seq, state, [token]) and seq.finish_reason is None:
                    seq.finish_reason = "stop"
            if seq.finish_reason is not None:
                break
        if not state.stops.stops:
            self._update_text(seq, state, step.tokens[:kept])
        if seq.finish_reason is not None and not isinstance(seq.stop_reason, str):
            state.text += state.detok.flush()
            state.visible_end = len(state.text)
        return kept

    def _update_text(self, seq: Sequence, state: _TextState, tokens: list[int]) -> bool:
        """Decode `tokens`; returns True when a stop string matched."""
        state.text += state.detok.add(tokens)
        end, stop = state.stops.check(state.text, state.visible_end)
        state.visible_end = end
        if stop is not None:
            seq.stop_reason = stop
            state.text = state.text[:end]
            return True
        return False

    def make_output(self, seq: Sequence) -> RequestOutput:
        state = self.states[seq.request_id]
        finished = seq.finish_reason is not None
        if finished:
            if seq.finish_reason != "stop" or not isinstance(seq.stop_reason, str):
                state.visible_end = len(state.text)  # nothing more can complete a stop string
            self.states.pop(seq.request_id, None)
        text = state.text[:state.visible_end]
        out_ids = seq.output_token_ids
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=out_ids,  # output_token_ids is a fresh slice already
            delta_text=text[state.sent_chars:],
            delta_token_ids=out_ids[state.sent_tokens:],
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
        )
        if seq.logprobs is not None:
            out.logprobs = list(seq.logprobs)
            out.delta_logprobs = seq.logprobs[state.sent_logprobs:]
            state.sent_logprobs = len(seq.logprobs)
        if seq.prompt_logprobs is not None:
            out.prompt_logprobs = seq.prompt_logprobs
        state.sent_chars, state.sent_tokens = len(text), len(out_ids)
        return out
