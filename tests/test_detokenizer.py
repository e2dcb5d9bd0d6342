"""engine/detokenizer.py: the stop-string matcher (against the previous implementation on random
inputs, and its cost) and the incremental detokenizer (each character released in the round that
completes it, against an incremental UTF-8 decoder over the tokens' bytes)."""

from __future__ import annotations

import codecs
import random
import time

import pytest
from test_tokenizer import byte_level_map, every_byte_vocabulary
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from graphserve.engine import detokenizer as engine_detokenizer
from graphserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from graphserve.engine.model_files.default_model import ensure_default_model
from graphserve.engine.tokenizer import Tokenizer


class ReferenceStopMatcher:
    """The previous StopStringMatcher, kept verbatim as the reference for the semantics."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.stops = stops
        self.include_stop = include_stop
        self.max_len = max((len(s) for s in stops), default=0)

    def check(self, text: str, num_emitted: int) -> tuple[int, str | None]:
        if not self.stops:
            return len(text), None
        search_from = max(0, num_emitted - self.max_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            i = text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            return (i + len(stop) if self.include_stop else i), stop
        hold = 0
        for stop in self.stops:  # longest text suffix that is a proper prefix of a stop string
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        return max(num_emitted, len(text) - hold), None


def _drive(matcher, chunks: list[str]) -> list[tuple[int, str | None]]:
    """As the output processor calls it: the whole text each time, num_emitted = the last end."""
    text, emitted, results = "", 0, []
    for chunk in chunks:
        text += chunk
        emitted, stop = matcher.check(text, emitted)
        results.append((emitted, stop))
        if stop is not None:
            break
    return results


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ensure_default_model(progress=False))


# ---- stop strings ------------------------------------------------------------------------


@pytest.mark.parametrize("alphabet", ["ab", "abc", "ab é\n"])
def test_stop_matcher_equals_the_previous_one_on_random_inputs(alphabet: str) -> None:
    rng = random.Random(hash(alphabet) & 0xFFFF)
    for _ in range(3000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(0, 6))]
        include = rng.random() < 0.5
        chunks = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 16))]
        expected = _drive(ReferenceStopMatcher(stops, include), chunks)
        assert _drive(StopStringMatcher(stops, include), chunks) == expected, (stops, include, chunks)


def test_stop_matcher_semantics() -> None:
    # no stop: everything is emitted
    assert StopStringMatcher([], False).check("abc", 0) == (3, None)
    # a stop spanning several tokens, with the partial stop held back meanwhile
    m = StopStringMatcher(["STOP"], False)
    assert m.check("ab S", 0) == (3, None)
    assert m.check("ab ST", 3) == (3, None)
    assert m.check("ab STx", 3) == (6, None)  # not a stop after all: released
    assert m.check("ab STx STO", 6) == (7, None)
    assert m.check("ab STx STOP and more", 7) == (7, "STOP")
    # include_stop_str_in_output: the emitted end includes the stop string
    assert _drive(StopStringMatcher(["STOP"], True), ["x S", "TOP", "y"]) == [(2, None), (6, "STOP")]
    # earliest start wins, even when a later-starting stop ends first
    assert StopStringMatcher(["bc", "abcd"], False).check("xabcd", 0) == (1, "abcd")
    # an equal start: the first in list order, as before
    assert StopStringMatcher(["abc", "ab"], False).check("zabc", 0) == (1, "abc")
    assert StopStringMatcher(["ab", "abc"], True).check("zabc", 0) == (3, "ab")
    # within one call a later-ending match still wins when it starts earlier
    assert _drive(StopStringMatcher(["ab", "xabc"], False), ["x", "abc"]) == [(0, None), (0, "xabc")]
    # duplicates and empty strings
    assert StopStringMatcher(["", "a", "a"], False).check("ba", 0) == (1, "a")
    assert StopStringMatcher([""], False).stops == []


@pytest.mark.parametrize("include", [False, True])
def test_stop_matcher_semantics_hold_deep_into_a_long_output(include: bool) -> None:
    """The rules above (earliest start; on an equal start the stop earlier in the list, when
    both end in the same token) also a thousand characters into an output streamed token by
    token."""
    words = "".join(random.Random(2).choice(["the ", "a ", "cat ", "sat ", "on ", "mat. "]) for _ in range(300))
    for stops, tail, stop, start in [(["abc", "ab"], "zabcd", "abc", 1), (["ab", "abc"], "zabcd", "ab", 1),
                                     (["bc", "xabcd"], "xabcd", "xabcd", 0)]:
        chunks = [words[i:i + 3] for i in range(0, len(words), 3)] + [tail[:start], tail[start:]]
        end = len(words) + start + (len(stop) if include else 0)
        assert _drive(StopStringMatcher(stops, include), chunks)[-1] == (end, stop)
        assert _drive(StopStringMatcher(stops, include), chunks) == _drive(ReferenceStopMatcher(stops, include), chunks)


def test_stop_matcher_recovers_from_calls_that_do_not_extend_the_text() -> None:
    ref, new = ReferenceStopMatcher(["hello"], False), StopStringMatcher(["hello"], False)
    for text, emitted in [("say hel", 0), ("say h", 0), ("say hello", 4), ("abc hello", 0), ("xx", 0)]:
        assert new.check(text, emitted) == ref.check(text, emitted), (text, emitted)


@pytest.mark.parametrize("alphabet", ["ab", "ab é\n"])
def test_stop_matcher_answers_calls_outside_the_stream_as_the_previous_one(alphabet: str) -> None:
    """Calls other than a growing text with num_emitted = the last end (a shorter text, more
    emitted than the last answer allowed, a call after a stop was found) get the previous
    matcher's answer, on random inputs: each is answered from the window it depends on."""
    rng = random.Random(len(alphabet))
    for _ in range(2000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        include = rng.random() < 0.5
        new, ref = StopStringMatcher(stops, include), ReferenceStopMatcher(stops, include)
        text, emitted = "", 0
        for _ in range(rng.randint(1, 12)):
            kind = rng.choice(["grow", "shorter", "ahead"])
            if kind == "shorter":
                text = text[:rng.randint(0, len(text))]
                emitted = min(emitted, len(text))
            else:
                text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
                if kind == "ahead":
                    emitted = rng.randint(emitted, len(text))
            answer = new.check(text, emitted)
            assert answer == ref.check(text, emitted), (stops, include, text, emitted)
            emitted = answer[0]


def test_stop_matcher_cost_does_not_grow_with_the_stops_or_the_text() -> None:
    """64 stops x 512 characters (the server's caps), each beginning like the text so
    that the automaton walks into them: the per-call cost stays at a few microseconds
    (the previous matcher took ~2 ms a call here)."""
    rng = random.Random(0)
    stops = ["the " + "".join(rng.choice("abcdefgh ") for _ in range(508)) for _ in range(64)]
    engine_detokenizer._stop_automaton.cache_clear()
    t0 = time.perf_counter()
    matcher = StopStringMatcher(stops, False)
    build = time.perf_counter() - t0
    chunk = " the cat sat on the mat and the dog"
    text, emitted = "", 0
    t0 = time.perf_counter()
    for _ in range(2000):
        text += chunk
        emitted, stop = matcher.check(text, emitted)
        assert stop is None
    per_call = (time.perf_counter() - t0) / 2000
    assert emitted >= len(text) - 512
    assert per_call < 200e-6, f"{per_call * 1e6:.1f} us per call"
    assert build < 2.0, f"automaton build {build:.2f} s"
    # n > 1 choices with the same stops share one automaton
    assert StopStringMatcher(stops, False)._ac is matcher._ac


def test_stop_matcher_reads_each_character_of_a_stream_once() -> None:
    """The cost promised above, counted rather than timed: as the output processor calls it
    (the whole text each time, num_emitted = the last end; the same text again after a token
    that completes no character), the matcher reads each character of the text once, however
    long the stops are (64 x 512 characters, the server's caps), not the last longest stop's
    worth again at every token."""
    reads = 0

    class Text(str):
        def __getitem__(self, index):
            nonlocal reads
            reads += 1
            return super().__getitem__(index)

    rng = random.Random(1)
    stops = ["the " + "".join(rng.choice("abcdefgh ") for _ in range(508)) for _ in range(64)]
    matcher = StopStringMatcher(stops, False)
    text, emitted = "", 0
    for _ in range(100):
        text += " the cat sat on the mat and the dog"
        for _ in range(2):  # again with no new text: a token that completes no character
            emitted, stop = matcher.check(Text(text), emitted)
            assert stop is None
    assert emitted >= len(text) - 512
    assert reads <= len(text)


# ---- incremental detokenizer --------------------------------------------------------------


DETOK_TEXTS = [
    "Hello world, héllo! 東京タワー 🚀🔥 naïve café ∑∫√\n  def f(x):\n\treturn x ** 2",
    "🚀" * 7 + " ok " + "é" * 5,
    "",
]


@pytest.mark.parametrize("per_add", [1, 3, 8])
@pytest.mark.parametrize("text", DETOK_TEXTS)
def test_detokenizer_deltas_concatenate_to_decode_all(tok: Tokenizer, text: str, per_add: int) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    ids = [*ids, tok.eos_token_id, *tok.encode(" after", add_special_tokens=False)]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip)
        deltas = [detok.add(ids[i:i + per_add]) for i in range(0, len(ids), per_add)]
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids, skip)
        assert not any("\ufffd" in d for d in deltas)  # never half a UTF-8 character


def test_detokenizer_holds_back_an_incomplete_character_and_flush_releases_it(tok: Tokenizer) -> None:
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1  # a byte-level vocabulary splits the emoji
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) == ""
    assert detok.flush() == tok.decode(ids[:1])  # the end of the stream: the replacement char
    detok = IncrementalDetokenizer(tok)
    assert detok.add(ids[:1]) + detok.add(ids[1:]) == "🚀"


def token_bytes(tok: Tokenizer, ids: list[int]) -> bytes:
    symbols = byte_level_map()
    return bytes(symbols[c] for i in ids for c in tok._tok.id_to_token(i))


def byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """`text` spelled with one single-byte token per byte (the vocabulary's byte tokens)."""
    symbol = {b: c for c, b in byte_level_map().items()}
    return [tok._tok.token_to_id(symbol[b]) for b in text.encode()]


# Characters of 2, 3 and 4 bytes split across tokens in every way the embedded vocabulary
# does it: a 2-byte character as two byte tokens, "■" (3 bytes) as 2 tokens or as 3 byte
# tokens, a space and half a "■" in one token, "🚀" (4 bytes) as 3 tokens or 4 byte tokens.
SPLIT_UNITS = {
    "Öa": lambda tok: tok.encode("Öa", add_special_tokens=False),
    "■": lambda tok: tok.encode("■", add_special_tokens=False),
    "■ byte tokens": lambda tok: byte_token_ids(tok, "■"),
    " ■": lambda tok: tok.encode(" ■", add_special_tokens=False),
    "🚀": lambda tok: tok.encode("🚀", add_special_tokens=False),
    "🚀 byte tokens": lambda tok: byte_token_ids(tok, "🚀"),
    "mixed": lambda tok: tok.encode(DETOK_TEXTS[0], add_special_tokens=False),
}


def _rounds(ids: list[int], chunk: int, first: int) -> list[list[int]]:
    """The ids as the engine returns them: `first` from the prefill (0 or 1), then rounds of `chunk`."""
    return ([ids[:first]] if first else []) + [ids[i:i + chunk] for i in range(first, len(ids), chunk)]


@pytest.mark.parametrize("first", [0, 1])
@pytest.mark.parametrize("chunk", [1, 2, 3, 8])
@pytest.mark.parametrize("unit", list(SPLIT_UNITS))
def test_detokenizer_releases_every_character_in_the_round_that_completes_it(
        tok: Tokenizer, unit: str, chunk: int, first: int) -> None:
    """Per round, exactly the characters whose bytes are all in by then: what an incremental
    UTF-8 decoder gives for the same bytes (it keeps only an incomplete last character).
    Every alignment of the characters to the round boundaries, starting mid-character too."""
    unit_ids = SPLIT_UNITS[unit](tok)
    assert any(tok.decode(unit_ids[:n]).endswith("\ufffd") for n in range(len(unit_ids)))  # it splits a character
    repeats = 1 if unit == "mixed" else 6
    for shift in range(len(unit_ids) if unit != "mixed" else 1):
        ids = (unit_ids * repeats)[shift:]
        detok = IncrementalDetokenizer(tok)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        deltas = []
        for i, round_ids in enumerate(_rounds(ids, chunk, first)):
            deltas.append(detok.add(round_ids))
            assert deltas[-1] == utf8.decode(token_bytes(tok, round_ids)), (shift, i, deltas)
        deltas.append(detok.flush())
        assert deltas[-1] == utf8.decode(b"", final=True)
        assert "".join(deltas) == tok.decode(ids)


def test_detokenizer_on_random_tokens_and_rounds(tok: Tokenizer) -> None:
    """Random runs of byte tokens (stray and invalid bytes too), split characters, words and
    EOS, in random rounds, with and without special tokens skipped: each round gives what an
    incremental UTF-8 decoder gives for its bytes, and all of it equals decode(ids)."""
    symbols = byte_level_map()
    # 0xED is left out: CPython's incremental decoder waits on ED A0..BF (a surrogate's
    # start), where decode (and the stream) give U+FFFD at once
    byte_ids = [i for c, b in symbols.items() if b != 0xED and (i := tok._tok.token_to_id(c)) is not None]
    pool = byte_ids + tok.encode("■ 🚀 Öa 東京タワー é ∑ hello", add_special_tokens=False)
    eos = tok.eos_token_id

    def bytes_of(ids: list[int], skip: bool) -> bytes:
        return b"".join((b"" if skip else tok.decode([i], False).encode()) if i == eos else token_bytes(tok, [i])
                        for i in ids)

    rng = random.Random(0)
    for case in range(600):
        ids = [eos if rng.random() < 0.05 else rng.choice(pool) for _ in range(rng.randint(1, 24))]
        skip = case % 2 == 0
        detok = IncrementalDetokenizer(tok, skip)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        deltas, i = [], 0
        while i < len(ids):
            round_ids = ids[i:i + rng.randint(1, 5)]
            i += len(round_ids)
            deltas.append(detok.add(round_ids))
            assert deltas[-1] == utf8.decode(bytes_of(round_ids, skip)), (ids, skip, deltas)
        deltas.append(detok.flush())
        assert deltas[-1] == utf8.decode(b"", final=True)
        assert "".join(deltas) == tok.decode(ids, skip), (ids, skip)


def _byte_fallback_tokenizer(path) -> Tokenizer:
    """A SentencePiece-style vocabulary written to `path`: a <0xNN> token for every byte (id 1 + NN),
    "▁" 257, "a" 258, "▁a" 259."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "a": 258, "▁a": 259}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>", byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.save(str(path / "tokenizer.json"))
    return Tokenizer(path)


def test_detokenizer_with_byte_fallback_tokens(tmp_path) -> None:
    """A SentencePiece-style vocabulary: characters it lacks are <0xNN> byte tokens, and a
    run of them decodes to U+FFFD per byte until the run is valid UTF-8."""
    tok = _byte_fallback_tokenizer(tmp_path)
    text = "a■ a Ö🚀a ■■é a🚀"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and "<0xE2>" in [tok._tok.id_to_token(i) for i in ids]

    def byte_of(i: int) -> bytes:
        piece = tok._tok.id_to_token(i)
        return bytes([int(piece[3:5], 16)]) if piece.startswith("<0x") else piece.replace("▁", " ").encode()

    for chunk in (1, 2, 3, 8):
        for first in (0, 1):
            detok = IncrementalDetokenizer(tok)
            utf8 = codecs.getincrementaldecoder("utf-8")("replace")
            deltas = []
            for i, round_ids in enumerate(_rounds(ids, chunk, first)):
                deltas.append(detok.add(round_ids))
                assert deltas[-1] == utf8.decode(b"".join(map(byte_of, round_ids))), (chunk, first, i, deltas)
            assert "".join(deltas) + detok.flush() == text


def test_a_stray_byte_after_a_complete_character_loses_no_text_after_it(tmp_path) -> None:
    """Byte-fallback tokens <E2 82 AC> (euro) then a stray <80>: decoded together the whole run is
    U+FFFD, so the window no longer starts with the euro already sent. The stray byte streams as
    U+FFFD and everything after it still comes, as a UTF-8 decoder replacing bad bytes gives it."""
    tok = _byte_fallback_tokenizer(tmp_path)
    byte = {b: 1 + b for b in range(256)}
    ids = [byte[0xE2], byte[0x82], byte[0xAC], byte[0x80], 258, byte[0xC3], byte[0x96], byte[0xFF], 259, 258]
    expected = b"\xe2\x82\xac\x80a\xc3\x96\xff a".decode("utf-8", "replace") + "a"
    assert expected == "€\ufffdaÖ\ufffd aa"
    for chunk in (1, 2, 3, len(ids)):
        detok = IncrementalDetokenizer(tok)
        text = ""
        for start in range(0, len(ids), chunk):
            text += detok.add(ids[start:start + chunk])
            assert expected.startswith(text), (chunk, text)
        assert text == expected, chunk  # the last id completes a character: nothing is held back
        assert detok.flush() == ""


def _complete_text(data: bytes) -> str:
    """`data` decoded, less a last character whose bytes are not all in: a proper prefix of a
    well-formed sequence of Unicode's table 3-7, which Python's strict decoder reports as an
    unexpected end of data."""
    for back in range(1, min(3, len(data)) + 1):
        try:
            data[-back:].decode()
            break
        except UnicodeDecodeError as e:
            if e.start == 0 and e.reason == "unexpected end of data":
                return data[:-back].decode(errors="replace")
    return data.decode(errors="replace")


# The first and last character of each row of table 3-7 (and a common one, "—" = E2 80 94),
# and byte sequences just outside those rows: a continuation byte alone, the leads C0, C1 and
# F5-FF, each lead's second byte one below or above its range, a character cut short.
EDGE_CHARACTERS = [chr(c) for c in (0x80, 0x7FF, 0x800, 0xFFF, 0x1000, 0xCFFF, 0xD000, 0xD7FF, 0xE000, 0xFFFF,
                                    0x10000, 0x3FFFF, 0x40000, 0xFFFFF, 0x100000, 0x10FFFF, 0x2014)]
ILL_FORMED = [b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xc2\x7f", b"\xc2\xc0", b"\xdf\xc0", b"\xe0\x9f\x80",
              b"\xe0\xa0\x7f", b"\xe0\xc0", b"\xe1\x7f", b"\xe1\x80\xc0", b"\xec\xc0", b"\xed\xa0\x80",
              b"\xed\x9f\xc0", b"\xee\x80\x7f", b"\xef\xbf\xc0", b"\xf0\x8f\x80\x80", b"\xf0\xc0", b"\xf0\x90\x80\x7f",
              b"\xf1\x7f", b"\xf1\x80\x80\xc0", b"\xf3\xc0", b"\xf4\x90\x80\x80", b"\xf4\x8f\xc0", b"\xf5\x80\x80\x80",
              b"\xf8\x88", b"\xfe", b"\xff", b"\xe2\xc3\xa9", b"\xf0\x90\xe2\x80\x94", b"\xf4\x8f\xbf"]


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_streamed_text_follows_the_well_formed_utf8_table_at_every_edge(tmp_path, chunk: int) -> None:
    """A model that writes characters byte by byte (every byte a token, as GPT-2-style
    vocabularies have): each round streams every character whose bytes are all in, so no
    well-formed character is ever broken into U+FFFD, and the U+FFFD of ill-formed bytes
    streams in the round that shows them ill-formed, not later. At the edges of every
    range of Unicode's table 3-7 (Python's strict decoder as the reference)."""
    tok = every_byte_vocabulary(tmp_path)
    for case in [c.encode() for c in EDGE_CHARACTERS] + ILL_FORMED:
        data = b"a" + case + b"z"
        for start in range(min(chunk, len(data))):  # every alignment of the rounds to the bytes
            detok = IncrementalDetokenizer(tok)
            ids, sent = list(data), ""
            rounds = [ids[:start]] if start else []
            rounds += [ids[i:i + chunk] for i in range(start, len(ids), chunk)]
            done = 0
            for round_ids in rounds:
                done += len(round_ids)
                sent += detok.add(round_ids)
                assert sent == _complete_text(data[:done]), (case, chunk, start, done, sent)
            assert sent + detok.flush() == data.decode(errors="replace") == tok.decode(ids)
