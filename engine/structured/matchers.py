"""Engine core: grammars being compiled, a matcher per constrained request, a batch's bitmasks."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

import torch

from graphserve.engine.structured.grammar import GrammarCompiler, error_text


@dataclass
class _Compiling:
    seq: object  # engine.request.Sequence
    future: Future
    deadline: float


class StructuredOutputs:
    """Engine core: grammars being compiled, one matcher per running constrained request,
    and the bitmasks of a batch. `bitmask(seqs)` gives what the sampler gets
    before a round's first step; `advance` moves the matchers on between two steps of a
    round (the tokens it takes are remembered); `accept` moves a matcher on by the tokens
    the host appends, or confirms what `advance` took already."""

    def __init__(self, compiler: GrammarCompiler, max_rows: int):
        self.compiler = compiler
        self.compiling: dict[str, _Compiling] = {}
        self.matchers: dict[str, object] = {}
        self.words = -(-compiler.vocab_size // 32)
        self._bitmask = torch.full((max_rows, self.words), -1, dtype=torch.int32)
        # per request, (token, accepted, grammar finished) of what advance() took inside a round
        # and the host has not appended yet
        self._taken: dict[str, deque[tuple[int, bool, bool]]] = {}
        # advance() runs on the mask feed's worker thread (engine/structured/mask_feed.py); the engine's
        # thread accepts, releases and adds matchers
        self._lock = threading.Lock()

    @property
    def num_requests(self) -> int:
        """Requests with a matcher or a grammar being compiled (read from another thread: len() only)."""
        return len(self.matchers) + len(self.compiling)

    def submit(self, seq) -> None:
        """Start compiling `seq`'s grammar; poll() hands the sequence back once it is ready."""
        spec = seq.params.grammar
        self.compiling[seq.request_id] = _Compiling(seq, self.compiler.submit(spec),
                                                    time.monotonic() + self.compiler.timeout_s)

    def poll(self, wait: bool = False) -> tuple[list, list[tuple[object, str]]]:
        """(sequences whose grammar is ready, with a matcher each; (sequence, error) pairs
        whose compilation failed or ran out of time). wait: first let every compilation finish
        or run out of time (tensor-parallel ranks must all admit the same requests)."""
        import xgrammar as xgr

        if wait and self.compiling:
            deadline = max(entry.deadline for entry in self.compiling.values())
            futures_wait([entry.future for entry in self.compiling.values()],
                         timeout=max(0.0, deadline - time.monotonic()))
        ready, failed = [], []
        now = time.monotonic()
        for request_id, entry in list(self.compiling.items()):
            if entry.future.done():
                del self.compiling[request_id]
                try:
                    compiled = entry.future.result()
                except Exception as exc:  # noqa: BLE001
                    failed.append((entry.seq, error_text(exc)))
                    continue
                with self._lock:
                    self.matchers[request_id] = self.compiler.matcher(compiled)
                ready.append(entry.seq)
            elif now > entry.deadline:
                del self.compiling[request_id]
                entry.future.add_done_callback(lambda f: f.exception())
                failed.append((entry.seq, f"the grammar took longer than {self.compiler.timeout_s:g}s to compile"))
        return ready, failed

    def release(self, request_id: str) -> None:
        """Forget a request's matcher (or its compilation): it finished or was aborted."""
        with self._lock:
            self.matchers.pop(request_id, None)
            self._taken.pop(request_id, None)
        self.compiling.pop(request_id, None)

    def constrained_rows(self, seqs: list) -> list[int]:
        """Indices of the rows of `seqs` that have a matcher."""
        return [i for i, s in enumerate(seqs) if s.request_id in self.matchers]

    def bitmask(self, seqs: list) -> torch.Tensor | None:
        """[len(seqs), ceil(V/32)] int32 on the host: the tokens each row may sample next
        (all bits set for unconstrained rows); None when no row is constrained."""
        rows = self.constrained_rows(seqs)
        if not rows:
            return None
        if len(seqs) > self._bitmask.shape[0]:
            self._bitmask = torch.full((len(seqs), self.words), -1, dtype=torch.int32)
        mask = self._bitmask[:len(seqs)]
        mask.numpy().fill(-1)  # numpy: torch's fill_ may wake its thread pool for this
        # one row after another: a few microseconds each, less than waking worker threads
        # (xgrammar's BatchGrammarMatcher with 2 threads measured slower at 1-64 rows)
        with self._lock:
            for i in rows:
                matcher = self.matchers[seqs[i].request_id]
                if matcher.is_terminated():
                    mask[i].numpy().fill(-1)  # its tokens from here on are dropped by the host
                else:
                    matcher.fill_next_token_bitmask(mask, i)
        return mask

    def advance(self, seqs: list, rows: list[int], tokens: list[int | None], out: torch.Tensor) -> None:
        """Inside a round: row rows[j] of `seqs` just sampled tokens[j] (None: nothing new since
        the host appended its tokens). Move its matcher on (remembered for accept()) and put
        its next mask in out[j]."""
        with self._lock:
            for j, (i, token) in enumerate(zip(rows, tokens)):
                request_id = seqs[i].request_id
                matcher = self.matchers.get(request_id)
                if matcher is None or matcher.is_terminated():  # ended (aborted, or its grammar is done)
                    out[j].numpy().fill(-1)
                    continue
                if token is not None:
                    accepted = matcher.accept_token(token)
                    self._taken.setdefault(request_id, deque()).append((token, accepted, matcher.is_terminated()))
                    if not accepted or matcher.is_terminated():
                        out[j].numpy().fill(-1)
                        continue
                matcher.fill_next_token_bitmask(out, j)

    def accept(self, request_id: str, token: int) -> tuple[bool, bool]:
        """Move the request's matcher on by `token`: (accepted, the grammar is finished)."""
        with self._lock:
            taken = self._taken.get(request_id)
            if taken:  # advance() took it inside the round already
                taken_token, accepted, done = taken.popleft()
                return accepted and taken_token == token, done
            matcher = self.matchers.get(request_id)
            if matcher is None:
                return True, False
            ok = matcher.accept_token(token)
            return ok, matcher.is_terminated()

    def allows_nothing(self, request_id: str) -> bool:
        """The request's grammar, where it stands, allows no token at all (a dead end)."""
        with self._lock:
            matcher = self.matchers.get(request_id)
            if matcher is None or matcher.is_terminated():
                return False
            row = torch.zeros((1, self.words), dtype=torch.int32)
            matcher.fill_next_token_bitmask(row, 0)
            return not bool(row.any())

    def forget_taken(self) -> None:
        """A round failed: roll every matcher back over what advance() took and the host did
        not append (call with no round being served)."""
        with self._lock:
            for request_id, taken in self._taken.items():
                matcher = self.matchers.get(request_id)
                if matcher is not None:
                    matcher.rollback(sum(1 for _, accepted, _ in taken if accepted))
            self._taken.clear()

