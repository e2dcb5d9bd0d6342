"""OutputProcessor: the text side of a request, where the request arrived (a front end,
or the offline engine). Turns the core's token ids into text deltas with an incremental
detokenizer and finds stop strings; tokens after a stop string are dropped, and the
caller tells the core to end the request."""

from __future__ import annotations

from graphserve.engine.core.messages import CoreOutput
from graphserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from graphserve.engine.request import RequestOutput, SamplingParams
from graphserve.engine.tokenizer import Tokenizer


class _TextState:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.prompt_token_ids = prompt_token_ids
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.text = ""  # everything decoded so far (it may run past a stop string); kept only with stop strings
        self.visible_end = 0  # text[:visible_end] may be shown
        self.sent_chars = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, _TextState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.states[request_id] = _TextState(self.tokenizer, prompt_token_ids, params)

    def discard(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, out: CoreOutput) -> tuple[RequestOutput, bool] | None:
        """The update for the client, and whether a stop string ended the request here (then
        the core must be told: it does not know). None for a request not (or no longer) here."""
        state = self.states.get(out.request_id)
        if state is None:
            return None
        token_ids, logprobs = out.token_ids, out.logprobs
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        stopped_here = False
        if state.stops.stops:
            for i, token in enumerate(token_ids):  # token by token: the stop's token ends the output
                stop = self._add_text(state, [token])
                if stop is not None:
                    token_ids, logprobs = token_ids[:i + 1], logprobs[:i + 1] if logprobs is not None else None
                    stopped_here = finish_reason is None or i + 1 < len(out.token_ids)
                    finish_reason, stop_reason = "stop", stop
                    break
        else:
            self._add_text(state, token_ids)
        finished = finish_reason is not None
        if finished and not isinstance(stop_reason, str):
            state.text += state.detok.flush()  # nothing more can complete a character or a stop string
            state.visible_end = len(state.text)
        text = state.text[state.sent_chars:state.visible_end]
        state.sent_chars = state.visible_end
        if not state.stops.stops:  # without stop strings nothing is held back: keep no history
            state.text, state.sent_chars, state.visible_end = "", 0, 0
        if finished:
            del self.states[out.request_id]
        update = RequestOutput(out.request_id, state.prompt_token_ids, text, token_ids, finished, finish_reason,
                               stop_reason, logprobs, out.prompt_logprobs, out.num_cached_tokens, out.error,
                               out.request_at_fault, out.core_times)
        return update, stopped_here

    def _add_text(self, state: _TextState, tokens: list[int]) -> str | None:
        """Decode `tokens`; returns the stop string that matched, if one did."""
        state.text += state.detok.add(tokens)
        end, stop = state.stops.check(state.text, state.visible_end)
        state.visible_end = end
        if stop is not None:
            state.text = state.text[:end]
        return stop
