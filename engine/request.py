"""What a user asks for (SamplingParams), the engine's per-request state (Sequence),
and what comes back (RequestOutput)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Sampling controls, OpenAI / vLLM semantics. temperature 0 means greedy."""

    max_tokens: int | None = 16  # None: as many as fit in max_model_len
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N alternatives per generated token (0 = only the chosen one)
    prompt_logprobs: int | None = None  # same for prompt tokens (echo with logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        checks = [
            (self.temperature >= 0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "repetition_penalty must be > 0"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
        if self.max_tokens is not None:
            if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
                raise InvalidRequestError(
                    f"max_tokens must be at least 1 (0 only with prompt logprobs / echo), got {self.max_tokens}",
                    param="max_tokens")
            self.min_tokens = min(self.min_tokens, self.max_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One update of one request. `text`/`token_ids`/`logprobs` are cumulative; the
    `delta_*` fields hold what is new since the previous update of this request."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first prompt token has none
    arrival_time: float = 0.0
    first_token_time: float | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Engine-side state of one request: its tokens, KV blocks, and progress."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_prefill_tokens = len(prompt_token_ids)  # reset to num_tokens on preemption
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        # sampling noise is a function of (seed, output position): fixed per request
        self.seed = seed
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_preemptions = 0
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True until every token present at (re)admission has its KV cached."""
        return self.num_computed_tokens < self.num_prefill_tokens
