"""Front-end text work per token: incremental detokenization and stop-string matching.

    python benchmarks/detok_bench.py [--streams 256] [--per-round 8] [--rounds 16]
                                     [--tokenizer DIR] [--out results/detok_bench-....json]

Detokenization, for `--streams` concurrent streams that each get `--per-round` new ids
per engine round (256 x 8 = 2,048 tokens every round), per token:
  python_window   the previous IncrementalDetokenizer: two Python-side `decode` calls of
                  a short window per add (kept here as the reference)
  decode_stream   tokenizers' own streaming decoder, `DecodeStream.step(tok, ids)`
                  (what IncrementalDetokenizer uses now when the library has it)
  decode_batch    the same window algorithm, but the windows of all streams decoded
                  with two `Tokenizer.decode_batch` calls per round
  engine_class    the IncrementalDetokenizer of engine/detokenizer.py as it is now
each both per round (add 8 ids at once) and per token (add 1 id at a time: what the
front end does while a request has stop strings). Every method's concatenated output is
checked against decode(all ids).

Tokenizers: the embedded SmolLM2 (49k vocabulary; when its folder exists) and a synthetic
byte-level BPE of 128k tokens built here (random words, plus byte tokens so that
multi-byte characters span tokens), so the bench also runs where no model is present.

Stop strings: time per `StopStringMatcher.check` call with 120 tokens of text appended
one token at a time, the previous matcher (copied here) against the Aho-Corasick one,
for 10,000 x 100 characters (the adversarial case of issue 14), 64 x 512 (the server's
caps) and 4 x 10 (ordinary use); plus the automaton's build time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import decoders, models, pre_tokenizers  # noqa: E402

from graphserve.engine import detokenizer as engine_detokenizer  # noqa: E402
from graphserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher, _StopAutomaton  # noqa: E402
from graphserve.engine.tokenizer import Tokenizer  # noqa: E402

TEXT = (
    "The engine core is a busy loop with no asyncio and no text; the front ends never touch tensors. "
    "Messages are compact (token ids, not text), batched per round. Ünïcödé: naïve café, 東京タワーは高い。 "
    "Emoji 🚀🔥 and math ∑∫√ appear too. def f(x):\n    return x ** 2  # squares\n"
)


# ---- tokenizers -----------------------------------------------------------------------


class _Wrapped(Tokenizer):
    """An engine Tokenizer around a tokenizers.Tokenizer built in memory."""

    def __init__(self, hf: HFTokenizer):  # noqa: D107 - no files to read
        self._tok = hf
        self.bos_token = self.eos_token = None
        self.add_bos_token = False
        self.chat_template = None
        self.eos_token_id = self.bos_token_id = None
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._template = None


def synthetic_tokenizer(vocab_size: int = 128_000, seed: int = 0) -> Tokenizer:
    """A byte-level BPE with `vocab_size` tokens: the 256 byte symbols (so multi-byte
    characters span tokens, as in real vocabularies), then random words with and without
    a leading space. No merges: it is for decoding, every id maps to real text."""
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        if rng.random() < 0.05:
            word += rng.choice(["é", "ü", "東", "京", "🚀"])
        text = (" " if rng.random() < 0.6 else "") + word
        sym = "".join(b2u[b] for b in text.encode())
        vocab.setdefault(sym, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return _Wrapped(tok)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map, which the ByteLevel decoder inverts."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def stream_ids(tok: Tokenizer, n_streams: int, length: int, seed: int) -> list[list[int]]:
    """Per stream, `length` ids: the token ids of a mixed-script text (each stream from
    another offset), and for a synthetic vocabulary, a share of random word ids too."""
    base = tok.encode(TEXT * (length // 20 + 2), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(n_streams):
        start = rng.randrange(0, len(base) - length)
        ids = base[start:start + length]
        if isinstance(tok, _Wrapped):  # the synthetic vocabulary: half the ids random words
            ids = [rng.randrange(256, tok.vocab_size) if rng.random() < 0.5 else i for i in ids]
        out.append(ids)
    return out


# ---- detokenization methods ---------------------------------------------------------------


class PythonWindowDetokenizer:
    """The previous IncrementalDetokenizer (two `decode` calls of a window per add)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd") and full_text.startswith(prefix_text):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""


def run_python_window(tok, streams, chunk):
    detoks = [PythonWindowDetokenizer(tok) for _ in streams]
    return _drive(streams, chunk, lambda i, ids: detoks[i].add(ids), [d.flush for d in detoks])


def run_engine_class(tok, streams, chunk):
    detoks = [IncrementalDetokenizer(tok) for _ in streams]
    return _drive(streams, chunk, lambda i, ids: detoks[i].add(ids), [d.flush for d in detoks])


def run_decode_stream(tok, streams, chunk):
    raw = tok._tok
    ds = [decoders.DecodeStream(skip_special_tokens=True) for _ in streams]

    def add(i, ids):
        return ds[i].step(raw, ids if len(ids) > 1 else ids[0]) or ""

    return _drive(streams, chunk, add, [lambda: "" for _ in ds])


def run_decode_batch(tok, streams, chunk):
    """The window algorithm with the windows of every stream decoded by two decode_batch
    calls per round."""
    raw = tok._tok
    n = len(streams)
    ids = [[] for _ in range(n)]
    pre = [0] * n
    read = [0] * n
    out = [[] for _ in range(n)]
    length = len(streams[0])
    t0 = time.perf_counter()
    for pos in range(0, length, chunk):
        for i in range(n):
            ids[i].extend(streams[i][pos:pos + chunk])
        prefix_texts = raw.decode_batch([ids[i][pre[i]:read[i]] for i in range(n)], skip_special_tokens=True)
        full_texts = raw.decode_batch([ids[i][pre[i]:] for i in range(n)], skip_special_tokens=True)
        for i in range(n):
            p, f = prefix_texts[i], full_texts[i]
            if len(f) > len(p) and not f.endswith("\ufffd") and f.startswith(p):
                pre[i], read[i] = read[i], len(ids[i])
                out[i].append(f[len(p):])
    elapsed = time.perf_counter() - t0
    tails = raw.decode_batch([ids[i][pre[i]:] for i in range(n)], skip_special_tokens=True)
    heads = raw.decode_batch([ids[i][pre[i]:read[i]] for i in range(n)], skip_special_tokens=True)
    return elapsed, ["".join(o) + t[len(h):] for o, t, h in zip(out, tails, heads)]


def _drive(streams, chunk, add, flushes):
    n = len(streams)
    out = [[] for _ in range(n)]
    length = len(streams[0])
    t0 = time.perf_counter()
    for pos in range(0, length, chunk):  # one engine round: every stream gets its ids
        for i in range(n):
            ids = streams[i][pos:pos + chunk]
            out[i].append(add(i, ids))
    elapsed = time.perf_counter() - t0
    return elapsed, ["".join(o) + f() for o, f in zip(out, flushes)]


METHODS = {
    "python_window": run_python_window,
    "decode_stream": run_decode_stream,
    "decode_batch": run_decode_batch,
    "engine_class": run_engine_class,
}


def bench_detok(name: str, tok: Tokenizer, args) -> list[dict]:
    length = args.per_round * args.rounds
    streams = stream_ids(tok, args.streams, length, seed=1)
    expected = [tok.decode(s) for s in streams]
    rows = []
    for chunk, mode in ((args.per_round, "per_round"), (1, "per_token")):
        for method, fn in METHODS.items():
            if method == "decode_stream" and not hasattr(decoders, "DecodeStream"):
                continue
            times = []
            for _ in range(args.repeats):
                elapsed, texts = fn(tok, streams, chunk)
                times.append(elapsed)
            # DecodeStream alone has no flush: a held-back incomplete character at the very
            # end is lost there; compare what it could emit
            ok = all(t == e or (method == "decode_stream" and e.startswith(t)) for t, e in zip(texts, expected))
            best = min(times)
            rows.append({
                "tokenizer": name, "vocab": tok.vocab_size, "mode": mode, "method": method,
                "streams": args.streams, "ids_per_add": chunk, "tokens": args.streams * length,
                "us_per_token": round(1e6 * best / (args.streams * length), 3),
                "ms_per_round_of_2048": round(1e3 * best / (length / args.per_round)
                                              * 2048 / (args.streams * args.per_round), 3),
                "output_equals_decode_all": ok,
            })
            print(f"{name:10s} {mode:9s} {method:16s} {rows[-1]['us_per_token']:8.3f} us/token"
                  f"  ok={ok}", flush=True)
    return rows


# ---- stop strings ---------------------------------------------------------------------------


class ReferenceStopMatcher:
    """The previous StopStringMatcher: every stop searched over a window on every call,
    then a quadratic hold-back scan."""

    def __init__(self, stops: list[str], include_stop: bool):
        self.stops = stops
        self.include_stop = include_stop
        self.max_len = max((len(s) for s in stops), default=0)

    def check(self, text: str, num_emitted: int) -> tuple[int, str | None]:
        if not self.stops:
            return len(text), None
        search_from = max(0, num_emitted - self.max_len + 1)
        best = None
        for stop in self.stops:
            i = text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is not None:
            i, stop = best
            return (i + len(stop) if self.include_stop else i), stop
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:n]):
                    hold = n
                    break
        return max(num_emitted, len(text) - hold), None


def bench_stops(tok: Tokenizer | None) -> list[dict]:
    rng = random.Random(2)
    if tok is not None:
        ids = tok.encode(TEXT * 4, add_special_tokens=False)[:120]
        chunks = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
        chunks = [b[len(a):] for a, b in zip([""] + chunks, chunks)]
    else:
        words = TEXT.split()
        chunks = [" " + rng.choice(words) for _ in range(120)]
    rows = []
    alphabet = "abcdefghijklmnopqrstuvwxyz eh"
    for n_stops, length in ((10_000, 100), (64, 512), (4, 10)):
        # random stops, each starting like the text ("The e...") so that the old hold-back
        # scan and the automaton both walk some way into them
        stops = ["The e" + "".join(rng.choice(alphabet) for _ in range(length - 5)) for _ in range(n_stops)]
        row = {"stops": n_stops, "chars_each": length, "calls": len(chunks)}
        engine_detokenizer._stop_automaton.cache_clear()
        t0 = time.perf_counter()
        _StopAutomaton(stops)
        row["automaton_build_ms"] = round(1e3 * (time.perf_counter() - t0), 2)
        for name, cls in (("old", ReferenceStopMatcher), ("new", StopStringMatcher)):
            engine_detokenizer._stop_automaton.cache_clear()
            t0 = time.perf_counter()
            m = cls(stops, False)
            construct = time.perf_counter() - t0
            text, emitted, times, results = "", 0, [], []
            for c in chunks:
                text += c
                t0 = time.perf_counter()
                emitted, stop = m.check(text, emitted)
                times.append(time.perf_counter() - t0)
                results.append((emitted, stop))
            row[f"{name}_construct_ms"] = round(1e3 * construct, 3)
            row[f"{name}_us_per_call_median"] = round(1e6 * statistics.median(times), 2)
            row[f"{name}_us_per_call_mean"] = round(1e6 * statistics.mean(times), 2)
            row[f"{name}_ms_total_120_calls"] = round(1e3 * sum(times), 2)
            row[f"{name}_results"] = results
        row["same_results"] = row.pop("old_results") == row.pop("new_results")
        # what every round of a front end (or engine thread) serving 4 such streams at
        # K = 8 tokens per round spends on them: the stall every other stream waits out
        for name in ("old", "new"):
            row[f"{name}_stall_ms_per_round_4_streams_k8"] = round(32 * row[f"{name}_us_per_call_mean"] / 1e3, 3)
        print(f"stops {n_stops:>6} x {length:>3}: old {row['old_us_per_call_median']:>10.1f} us/call, "
              f"new {row['new_us_per_call_median']:>6.2f} us/call (+ build {row['automaton_build_ms']} ms once), "
              f"same={row['same_results']}", flush=True)
        rows.append(row)
    return rows


# ---- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--per-round", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", default=None, help="a model folder with tokenizer.json "
                        "(default: the embedded SmolLM2's, when prepared)")
    parser.add_argument("--no-synthetic", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    toks: list[tuple[str, Tokenizer]] = []
    path = args.tokenizer
    if path is None:
        from graphserve.engine.model_files.default_model import default_model_path

        candidate = default_model_path()
        path = str(candidate) if (candidate / "tokenizer.json").is_file() else None
    if path is not None:
        toks.append((Path(path).name, Tokenizer(path)))
    if not args.no_synthetic:
        t0 = time.perf_counter()
        toks.append(("synthetic-128k", synthetic_tokenizer()))
        print(f"synthetic 128k tokenizer built in {time.perf_counter() - t0:.1f} s", flush=True)

    detok_rows = []
    for name, tok in toks:
        detok_rows += bench_detok(name, tok, args)
    stop_rows = bench_stops(toks[0][1] if toks else None)

    result = {
        "benchmark": "detok_bench",
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"tokenizers": tokenizers.__version__},
        "env": {k: os.environ[k] for k in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS") if k in os.environ},
        "config": {"streams": args.streams, "ids_per_round": args.per_round, "rounds": args.rounds,
                   "repeats": args.repeats, "timing": "best of repeats"},
        "detokenize": detok_rows,
        "stop_strings": stop_rows,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
