"""Token ids to text as they arrive: the incremental detokenizer and the stop-string matcher."""

from __future__ import annotations

import functools

from tokenizers import decoders

from graphserve.engine.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Each add releases every character
    whose bytes are all in and holds back at most one incomplete character (never half a
    UTF-8 character); the concatenated deltas equal decode(all ids). Decodes only a short
    window: the last emitted token(s) as context plus the new ones, so the cost per token
    is constant.

    The window algorithm runs inside tokenizers (`decoders.DecodeStream`), fed one id at a
    time: it releases text at every id after which the window's text does not end in
    U+FFFD. Fed a round's ids at once, it would check only after the last one, and a round
    that ends mid-character would hold back everything before it too; with 2-token
    characters and a 2-step round every round can end so, and a whole stream came out at
    its end. The ids the stream still holds after the last one (from `read_offset` on) may
    start with complete characters (one token can be a space plus two bytes of "■"):
    `_release_tail` sends those. `prefix_offset`/`read_offset` mirror the stream's window,
    so `flush` (which DecodeStream lacks) decodes what is still held back."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # ids before this are already in the text
        self._tail_sent = ""  # the text of ids[read_offset:] already sent by _release_tail
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        if not new_ids:
            return ""
        pieces = []
        for token in new_ids:
            self.ids.append(token)
            pieces += self._step(len(self.ids) - 1)
        text = "".join(pieces)
        if pieces and self._tail_sent:  # the first piece starts with what was sent of it
            text, self._tail_sent = text[len(self._tail_sent):], ""
        if self.read_offset < len(self.ids):
            text += self._release_tail()
        return text

    def _step(self, index: int) -> list[str]:
        """Feeds ids[index] to the stream: the piece it releases, if any."""
        try:
            piece = self._stream.step(self.tokenizer.backend, self.ids[index])
        except Exception:
            return self._restart_window()
        return self._released(piece, index)

    def _released(self, piece: str | None, index: int) -> list[str]:
        """A piece the stream gave at ids[index] moves the window past that id."""
        if piece is None:
            return []
        self.prefix_offset = self.read_offset
        self.read_offset = index + 1
        return [piece]

    def _restart_window(self) -> list[str]:
        """The window's text no longer starts with what it already released: in a byte-fallback
        vocabulary a stray byte right after a complete character turns the whole run of byte tokens,
        that character's included, into U+FFFD. What was sent stands; the held ids start a fresh
        window, so the stray byte reads as U+FFFD and the text after it still comes."""
        self._stream = decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)
        start = self.prefix_offset = self.read_offset
        pieces = []
        for index in range(start, len(self.ids)):  # a fresh window has no prefix to lose: no restart here
            pieces += self._released(self._stream.step(self.tokenizer.backend, self.ids[index]), index)
        return pieces

    def _release_tail(self) -> str:
        """What is not yet sent of the held ids' text, up to an incomplete last character."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if not full_text.startswith(prefix_text):
            return ""
        tail = full_text[len(prefix_text):]
        held = incomplete_chars(self.tokenizer, self.ids[self.read_offset:], tail, self.skip_special_tokens)
        text = tail[len(self._tail_sent):len(tail) - held]
        self._tail_sent += text
        if tail.endswith("\ufffd") and not held:
            # Stray bytes (byte-level vocabularies only): their U+FFFD is final, and DecodeStream
            # would hold it until a character follows. A byte-level decode needs no context,
            # so a fresh window starts here.
            self.prefix_offset = self.read_offset = len(self.ids)
            self._tail_sent = ""
            self._stream = decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)
        return text

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes to U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        self._stream = decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)  # a fresh window
        text = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        text, self._tail_sent = text[len(self._tail_sent):], ""
        return text


def incomplete_chars(tokenizer: Tokenizer, ids: list[int], text: str, skip_special_tokens: bool) -> int:
    """How many characters at the end of `text` (what `ids` decode to, in context) stand
    for a UTF-8 character whose bytes are not all in yet. In a byte-level vocabulary the
    tokens' bytes tell: 1 when they end in the start of a valid character, else 0 (a
    stray byte's U+FFFD is final). Otherwise every trailing U+FFFD counts (a run of
    byte-fallback tokens decodes to one per byte until it is valid UTF-8)."""
    if not text.endswith("\ufffd"):
        return 0
    byte_of = tokenizer.byte_of_symbol
    tail = b""
    for token in reversed(ids):  # an incomplete character has at most 3 bytes
        if byte_of is None or len(tail) >= 3:
            break
        if skip_special_tokens and token in tokenizer.special_token_ids:  # decodes to nothing
            continue
        if token in tokenizer.added_token_ids:  # its text ends any character before it
            break
        symbols = tokenizer.backend.id_to_token(token) or ""
        if any(c not in byte_of for c in symbols):
            byte_of = None
            break
        tail = bytes(byte_of[c] for c in symbols) + tail
    if byte_of is None:
        return len(text) - len(text.rstrip("\ufffd"))
    return 1 if _ends_in_char_start(tail[-3:]) else 0


_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}  # else 0x80-0xBF


def _ends_in_char_start(data: bytes) -> bool:
    """Whether `data` ends in the first bytes of a UTF-8 character that more bytes can
    complete (the well-formed sequences of Unicode's table 3-7)."""
    for back in range(1, min(3, len(data)) + 1):
        lead = data[-back]
        if 0x80 <= lead <= 0xBF:  # a continuation byte: the start is further back
            continue
        length = 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else 4 if 0xF0 <= lead <= 0xF4 else 1
        if length <= back:
            return False
        low, high = _SECOND_BYTE.get(lead, (0x80, 0xBF))
        rest = data[len(data) - back + 1:]
        return not rest or (low <= rest[0] <= high and all(0x80 <= b <= 0xBF for b in rest[1:]))
    return False


class _StopAutomaton:
    """Aho-Corasick automaton over the stop strings, built once per request in
    O(total characters of the stops).

    Per state: goto edges, failure link, depth (the length of the longest suffix of the
    text read so far that is a prefix of some stop string) and the best stop string that
    ends there: the longest (so the earliest start), a duplicate keeping its first index."""

    __slots__ = ("goto", "fail", "depth", "out_len", "out_idx")

    def __init__(self, stops: list[str]):
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        out_len = [0]
        out_idx = [-1]
        for idx, stop in enumerate(stops):
            s = 0
            for ch in stop:
                nxt = goto[s].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[s][ch] = nxt
                    goto.append({})
                    depth.append(depth[s] + 1)
                    out_len.append(0)
                    out_idx.append(-1)
                s = nxt
            if out_idx[s] == -1:
                out_len[s], out_idx[s] = len(stop), idx
        fail = [0] * len(goto)
        queue = list(goto[0].values())  # depth 1: fail to the root
        for s in queue:  # breadth first, so fail[s] (shallower) is complete before s
            f = fail[s]
            if out_idx[s] == -1:  # not a stop itself: the longest stop that is a suffix
                out_len[s], out_idx[s] = out_len[f], out_idx[f]
            for ch, t in goto[s].items():
                g = f
                while ch not in goto[g] and g:
                    g = fail[g]
                fail[t] = goto[g].get(ch, 0)
                queue.append(t)
        self.goto, self.fail, self.depth, self.out_len, self.out_idx = goto, fail, depth, out_len, out_idx


@functools.lru_cache(maxsize=4)
def _stop_automaton(stops: tuple[str, ...]) -> _StopAutomaton:
    """The automaton is read-only once built (a matcher keeps its own state), so requests
    with the same stops (the n choices of one request) share it."""
    return _StopAutomaton(list(stops))


class StopStringMatcher:
    """Finds stop strings across token boundaries and holds back any text that might be
    the start of one, so that a stop string is never partly streamed.

    One Aho-Corasick automaton over all stops; its state is kept across calls, so a call
    costs O(new characters) (amortized), whatever the number and length of the stops.
    Empty stop strings are ignored (SamplingParams drops them already)."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.max_len = max((len(s) for s in self.stops), default=0)
        # Built here, at admission: O(total characters), ~25 ms in pure Python at
        # 64 stops x 512 characters; n > 1 choices with the same stops share one.
        self._ac = _stop_automaton(tuple(self.stops)) if self.stops else None
        self._state = 0  # automaton state after text[:self._scanned]
        self._scanned = 0
        self._last_end = 0  # what the last call allowed to be emitted
        self._done = False  # the last call found a stop

    def check(self, text: str, num_emitted: int) -> tuple[int, str | None]:
        """Given the whole text and how much of it was emitted, return (end, stop):
        text[:end] may be emitted now; `stop` is the matched stop string or None.

        The earliest match (by start) wins; on an equal start the stop earlier in the
        list wins. Calls are expected to pass a growing text and the `end` they were
        given as `num_emitted`; any other call rescans the window the answer depends on
        (from num_emitted - longest stop + 1), with the same result."""
        if not self.stops:
            return len(text), None
        ac = self._ac
        n = len(text)
        if self._done or n < self._scanned or num_emitted > self._last_end:
            self._state, self._scanned = 0, max(0, num_emitted - self.max_len + 1)
            self._done = False
        goto, fail, out_len = ac.goto, ac.fail, ac.out_len
        s = self._state
        best_start = n
        best_idx = -1
        pos = self._scanned
        # A match ending at pos starts at >= pos - max_len + 1: scan until no later
        # match can start earlier than (or as early as) the best one found.
        limit = n
        while pos < limit:
            ch = text[pos]
            while True:
                nxt = goto[s].get(ch)
                if nxt is not None:
                    s = nxt
                    break
                if not s:
                    break
                s = fail[s]
            length = out_len[s]
            if length:
                start = pos - length + 1
                idx = ac.out_idx[s]
                if start < best_start or (start == best_start and idx < best_idx):
                    best_start, best_idx = start, idx
                    limit = min(n, start + self.max_len)
            pos += 1
        if best_idx >= 0:
            self._done = True
            stop = self.stops[best_idx]
            end = best_start + len(stop) if self.include_stop else best_start
            self._last_end = end
            return end, stop
        self._state, self._scanned = s, n
        end = max(num_emitted, n - ac.depth[s])
        self._last_end = end
        return end, None
