"""What a user asks for (SamplingParams), the engine's per-request state (Sequence),
and what comes back (RequestOutput)."""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from graphserve.engine.errors import InvalidRequestError
from graphserve.engine.structured.grammar import GrammarSpec

MAX_LOGPROBS = 20
# Bounds on what one request may ask for: the HTTP protocol's schema names them (a 400 naming
# the field) and SamplingParams.validate checks them where a request enters. Integers reach the device as
# int64 and must fit int32 where they count tokens; floats must be finite.
MAX_TOKEN_COUNT = 2**31 - 1  # max_tokens, min_tokens, top_k
# max_tokens left out: OpenAI's default for /v1/completions and vLLM's SamplingParams' (chat's is
# None, as many as fit). The one place it is decided: SamplingParams and the completions body read it.
DEFAULT_MAX_TOKENS = 16
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI and vLLM accept; the sampler hashes the low 32 bits
MAX_TEMPERATURE = 100.0  # logits / T stays finite in float32 (OpenAI caps at 2, vLLM has no cap)
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias|, as OpenAI
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI allows 300
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 256


@dataclass
class SamplingParams:
    """Sampling controls, OpenAI / vLLM semantics. temperature 0 means greedy.

    Checked once, by `validate()`, where a request enters: the HTTP front end
    (server/request_params.py) and the offline engine (LLMEngine.make_sequence). Constructing,
    copying (`dataclasses.replace`) and decoding one from a message check nothing: past the
    edge every part of the engine trusts it."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: as many as fit in max_model_len
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
    grammar: GrammarSpec | None = None  # constrain the output (response_format, tool calls)

    def validate(self) -> "SamplingParams":
        """Check every field (InvalidRequestError naming it) and normalize in place: `stop` a
        list, empty stops dropped. Returns self. (min_tokens is clamped to max_tokens where
        max_tokens gets its final value: engine/inputs.py's fit_max_tokens.)"""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self._check_bounds()
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
        return self

    def _check_bounds(self) -> None:
        """Types, finiteness and the caps above: what the engine can represent, checked before
        a value reaches a tensor shared with other requests."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
        _check_int("top_k", self.top_k, -1, MAX_TOKEN_COUNT)
        _check_int("min_tokens", self.min_tokens, 0, MAX_TOKEN_COUNT)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 0, MAX_TOKEN_COUNT)
        if self.seed is not None:
            _check_int("seed", self.seed, SEED_MIN, SEED_MAX)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        if self.temperature > MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}",
                                      param="temperature")
        if self.repetition_penalty > MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be <= {MAX_REPETITION_PENALTY:g}, got {self.repetition_penalty}",
                param="repetition_penalty")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}",
                                      param="stop")
        for stop in self.stop:
            if not isinstance(stop, str) or len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop: each stop string must be a string of at most {MAX_STOP_STRING_CHARS} characters",
                    param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} token ids are allowed, got {len(self.stop_token_ids)}",
                param="stop_token_ids")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, MAX_TOKEN_COUNT)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {len(self.logit_bias)}",
                param="logit_bias")
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, 0, MAX_TOKEN_COUNT)
            if (isinstance(bias, bool) or not isinstance(bias, numbers.Real) or not math.isfinite(bias)
                    or abs(bias) > MAX_LOGIT_BIAS_VALUE):
                raise InvalidRequestError(
                    f"logit_bias: each bias must be a number in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}], "
                    f"got {bias!r}", param="logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def filters_top(self, vocab_size: int) -> bool:
        """Sampled with a top-k, top-p or min-p filter (a greedy request never is)."""
        return not self.greedy and (0 < self.top_k < vocab_size or self.top_p < 1 or self.min_p > 0)

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name)


@dataclass
class TokenLogprob:
    """The chosen token's log-probability and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One update of one request: what it added since the previous update (text, token ids,
    logprobs), so a slow reader's queue costs what it holds, not the length squared. The
    offline API merges a request's updates into one, which then holds the whole output."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # in the first update; the first token has none
    num_cached_tokens: int = 0  # in the first update: prompt tokens served from the prefix cache
    error: str | None = None  # with finish_reason "error": what went wrong, when known
    request_at_fault: bool = False  # with finish_reason "error": the request asked for what cannot be (a 4xx)
    # in the update with the first token: (first scheduled, first token on the engine's host),
    # time.monotonic() in the engine core
    core_times: tuple[float, float] | None = None

    def merge(self, later: "RequestOutput") -> None:
        """Append a later update of the same request to this one."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.core_times = self.core_times or later.core_times
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.error = later.error


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA adapter a request runs with: its name (what the request's `model` said), an id unique to
    this load of it (> 0; the key of its weights in the engine and of its prefix-cache blocks, so KV is
    never shared across adapters, nor across two loads under one name) and its PEFT folder."""

    name: str
    lora_id: int
    path: str


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Engine-side state of one request: its tokens, KV blocks, and progress."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int = 0,
                 lora: LoraRequest | None = None):
        self.request_id = request_id
        self.lora = lora  # the adapter it runs with; None: the base model
        self.lora_slot = -1  # the device slot holding its adapter's weights, set before each step it is in
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt + generated
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_prefill_tokens = len(prompt_token_ids)  # reset to num_tokens on preemption
        # per KV cache group (engine/sched/kv_cache.py KVGroups; one group unless layers' windows differ):
        # its block table, the prefix-cache keys of its first full blocks registered there, and the
        # blocks a windowed pool promised its prefill's next chunks
        self.block_tables: list[list[int]] = [[]]
        self.group_hashes: list[list[bytes]] = [[]]
        self.group_reserved: list[int] = [0]
        self.block_keys: list[bytes] = []  # the hash chain of its full blocks so far (made once, kv_cache.py)
        self.block_tokens: list[bytes] = []  # those blocks' token ids as int64 bytes (made with the keys)
        self.computing_keys: list[bytes] = []  # keys of the blocks its admitted prefill computes
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache at admission
        self.status = SequenceStatus.WAITING
        # sampling noise is a function of (seed, output position): fixed per request
        self.seed = seed
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None  # the stop token id that ended it (None for EOS)
        self.error: str | None = None  # with finish_reason "error", when the request's own grammar is the cause
        self.num_preemptions = 0
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        # when a prefill step first took it: time.monotonic() (CLOCK_MONOTONIC, one clock for the
        # engine core and the front ends)
        self.scheduled_at: float | None = None

    @property
    def block_table(self) -> list[int]:
        """The block table of KV cache group 0 (the only one of most models; else the full-attention group)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def block_hashes(self) -> list[bytes]:
        """Group 0's registered prefix-cache keys."""
        return self.group_hashes[0]

    def ensure_kv_groups(self, num_groups: int) -> None:
        """A table, keys and reservation for each of `num_groups` KV cache groups."""
        while len(self.block_tables) < num_groups:
            self.block_tables.append([])
            self.group_hashes.append([])
            self.group_reserved.append(0)

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
    def num_tokens_left(self) -> int:
        """Tokens it may still generate: max_tokens (fitted to the context where the request
        entered, engine/inputs.py) less those generated. The one place the core reads max_tokens."""
        return self.params.max_tokens - self.num_output_tokens

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
