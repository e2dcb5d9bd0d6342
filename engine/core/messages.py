"""The messages between the front ends and the engine core, defined once.

Front ends talk to the core over one ZeroMQ DEALER socket each; the core holds the
ROUTER end and knows every front end by its socket identity. Frames are msgpack
(msgspec); the core never sees text, the front ends never see tensors. One
`RoundOutputs` per front end per engine step carries every request's new tokens.
"""

from __future__ import annotations

import msgspec
from graphserve.engine.request import LoraRequest, SamplingParams, TokenLogprob
from graphserve.engine.stats import EngineStats

# ---- front end -> core ----------------------------------------------------------------


class Hello(msgspec.Struct, tag=True, array_like=True):
    """A front end connected; the core answers with CoreReady once the model is loaded."""


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A validated request: prompt ids, and params whose max_tokens fits max_model_len."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # the prefix cache's keys of the prompt's full blocks (engine/sched/prefix_hash.py prompt_keys),
    # hashed in the front end so that the core does not; None: the core hashes
    prompt_block_keys: list[bytes] | None = None
    lora: LoraRequest | None = None  # the LoRA adapter it runs with (the keys then hash under its root)


class Abort(msgspec.Struct, tag=True, array_like=True):
    """End these requests now and free their blocks; no output follows (the client left,
    or the front end found a stop string)."""

    request_ids: list[str]


class InjectFault(msgspec.Struct, tag=True, array_like=True):
    """Tests only: see EngineCore.inject_fault."""

    kind: str


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Leave the loop (the core thread of an in-process server)."""


# ---- core -> front end ----------------------------------------------------------------


class CoreReady(msgspec.Struct, tag=True, array_like=True):
    """What a front end needs to validate prompts and detokenize."""

    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    stats: EngineStats
    block_size: int = 16
    prefix_cache_root: bytes | None = None  # the hash chain's root; None: prefix caching is off
    warmed_up: bool = False  # the core ran its warm-up burst: the front ends warm their own path too


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step added to one request. finish_reason: "stop" (EOS or a stop token id,
    then stop_reason is that id unless it is EOS), "length", or "error" (a step that
    failed with this request in it; its batch mates were retried without it)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first output only
    num_cached_tokens: int = 0  # with the first output: prompt tokens whose KV the prefix cache held
    error: str | None = None  # with finish_reason "error", when there is something to say
    request_at_fault: bool = False  # with finish_reason "error": the request asked for what cannot be (a 4xx)
    # with the first token: (first scheduled, first token on the host), time.monotonic()
    core_times: tuple[float, float] | None = None


class RoundOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[CoreOutput]
    stats: EngineStats | None = None  # sent when changed, at most every STATS_INTERVAL_S


class CoreDied(msgspec.Struct, tag=True, array_like=True):
    """The core loop stopped after an unrecoverable error; it exits next."""

    error: str


# ---- engine core (tensor-parallel rank 0) -> the other ranks ------------------------------


class StepInputs(msgspec.Struct, array_like=True):
    """What rank 0 took from its front ends since its last step, in order, for every other
    rank to apply before the same step (engine/core/rank_worker.py): so every rank's scheduler makes
    the same decisions. seeds: each added request's sampling seed (rank 0 draws them).
    wake_only: rank 0 does not step after this one; it is sent so that the ranks leave their
    wait (CoreLoop.wake_ranks, on SIGUSR1)."""

    adds: list[AddRequest] = []
    seeds: list[int] = []
    aborts: list[str] = []
    faults: list[str] = []
    stop: bool = False
    wake_only: bool = False


ToCore = Hello | AddRequest | Abort | InjectFault | Shutdown
FromCore = CoreReady | RoundOutputs | CoreDied

_encoder = msgspec.msgpack.Encoder()
_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)


def encode(message: ToCore | FromCore) -> bytes:
    return _encoder.encode(message)


def decode_to_core(frame: bytes) -> ToCore:
    return _to_core.decode(frame)


def decode_from_core(frame: bytes) -> FromCore:
    return _from_core.decode(frame)


_step_inputs = msgspec.msgpack.Decoder(StepInputs)


def decode_step_inputs(frame: bytes) -> StepInputs:
    return _step_inputs.decode(frame)
