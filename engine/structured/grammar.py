"""Grammar-constrained decoding with xgrammar: what a request asks for (GrammarSpec), and its
compilation (bounded in time and size, cached by spec). The engine core's matchers and bitmasks
are engine/structured/matchers.py.

The front end compiles a new spec once to reject it (400) before anything is queued;
the engine core compiles it again, off its loop, in a worker thread (xgrammar releases
the GIL), from its own cache. A request joins the scheduler only when its grammar is
ready, so compilation never stalls other requests."""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import msgspec

from graphserve.engine.errors import InvalidRequestError
from graphserve.engine.structured.vocabulary import Utf8Matcher, Utf8Tables, special_token_texts, tokenizer_info

# what a spec may hold before anything is compiled: xgrammar's work grows with it
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
DEFAULT_COMPILE_TIMEOUT_S = 10.0
GRAMMAR_CACHE_BYTES = 512 * 1024**2  # compiled grammars kept by spec, the least recently used dropped first


class GrammarSpec(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the output. kind: "json_schema" (value: the schema as JSON text),
    "json_object" (any JSON object), "regex", "choice" (value: a JSON list of strings),
    "grammar" (EBNF, xgrammar's dialect of GBNF), or "structural_tag" (xgrammar's
    structural tag as JSON: tool calls). `param`: the request field it came from, for
    error messages. `reasoning` (a reasoning parser is on): the constraint starts only after
    the thinking, which it leaves free: "inside" (the output starts inside an open
    `<think>`: any text up to `</think>`), "may_open" (the output may open `<think>` itself:
    then any text up to `</think>`; else the constraint from the start); whitespace may
    follow `</think>` (two characters at most: Qwen3 writes a blank line). gpt-oss's harmony
    format: "harmony" (the constraint is the body of the final channel's message: any text,
    analysis and commentary messages, up to the final channel's header, `<|channel|>final`, a
    content type or none, `<|message|>`), "harmony_messages" (the grammar describes harmony's
    messages itself, thinking included: a tool grammar, server/harmony_grammar.py). Both read
    harmony's control tokens as the text they spell (HARMONY_MARKERS): such a request keeps
    special tokens in its text."""

    kind: str
    value: str = ""
    param: str = "response_format"
    reasoning: str = ""


JSON_OBJECT_SCHEMA = '{"type": "object"}'
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def error_text(exc: Exception) -> str:
    """The first line of an xgrammar error, without its source-location prefix."""
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def ebnf_string(text: str) -> str:
    """`text` as an EBNF string literal of xgrammar's dialect: printable ASCII as it is, every other
    character as a fixed-width escape (\\uXXXX, or \\UXXXXXXXX past the BMP). JSON's escapes would not
    do: it writes a character past the BMP as a surrogate pair, which xgrammar reads as two code points."""
    out = ['"']
    for char in text:
        if char in '"\\':
            out.append("\\" + char)
        elif " " <= char <= "~":
            out.append(char)
        else:
            out.append(f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}")
    out.append('"')
    return "".join(out)


def _is_unicode_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`."""
    return "root ::= " + " | ".join(ebnf_string(c) for c in choices)


# xgrammar prints a character below U+0100 as \xHH, but reads \x with every hex digit that follows
# ("\xee7" -> U+0EE7, not "î7"): printed grammars are made re-readable by widening these to \u00HH.
_PRINTED_HEX_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\x([0-9a-fA-F]{2})")


def reparse(grammar):
    """`grammar` (an xgrammar Grammar, or its printed text edited), read by xgrammar again without
    changing what it accepts."""
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(_PRINTED_HEX_ESCAPE.sub(r"\1\\u00\2", str(grammar)))


def check_spec(spec: GrammarSpec) -> None:
    """Bounds and well-formedness, without a tokenizer (cheap): raises InvalidRequestError
    naming spec.param. Compilation can still fail or time out (GrammarCompiler)."""
    if spec.kind not in KINDS:
        raise InvalidRequestError(f"unsupported constraint type {spec.kind!r}", param=spec.param)
    if len(spec.value) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"the {spec.kind} is too large: at most {MAX_SPEC_CHARS} characters",
                                  param=spec.param)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except ValueError:
            choices = None
        if (not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in choices)):
            raise InvalidRequestError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings",
                                      param=spec.param)
        if not all(map(_is_unicode_text, choices)):  # no UTF-8 spells a lone surrogate: no token could
            raise InvalidRequestError("choice strings must be Unicode text: one holds an unpaired surrogate",
                                      param=spec.param)
    _grammar(spec)


# xgrammar 0.2.9 writes the characters of a JSON string with a length bound as this class, which
# lets raw control characters (U+0000-001F) through: strict JSON parsers (json.loads, pydantic)
# reject them. Its unbounded strings already exclude them, as here.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_strings_without_controls(grammar):
    """`grammar` with every JSON string character class excluding the control characters."""
    import xgrammar as xgr

    ebnf = str(grammar)
    if _BOUNDED_STRING_CHAR not in ebnf:
        return grammar
    return reparse(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


REASONING_MODES = ("", "inside", "may_open", "harmony", "harmony_messages")
THINK_START, THINK_END = "<think>", "</think>"
# gpt-oss's harmony format (server/harmony.py reads it): its control tokens; the final channel's header,
# where the answer starts; and the rest of a header after its channel (and recipient): a content type or none
# (gpt-oss writes " <|constrain|>json" before JSON, in a call or a final answer), then <|message|>
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
HARMONY_FINAL = "<|channel|>final"
HARMONY_HEADER_END = 'root ::= ((" <|constrain|>" | "<|constrain|>" | " ") [a-zA-Z]{1,16})? "<|message|>"'


def reads_harmony(spec: GrammarSpec) -> bool:
    """Whether the spec's grammar reads harmony's control tokens as text (its vocabulary spells them)."""
    return spec.reasoning in ("harmony", "harmony_messages")


def _free_text_up_to(begin: str, end: str):
    """`begin`, any text, then `end` (the text holds no `end` before it)."""
    import xgrammar as xgr

    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": end}}))


def _grammar(spec: GrammarSpec):
    """The spec's grammar; with `reasoning`, free thinking up to `</think>` (or harmony's final channel) before it."""
    import xgrammar as xgr

    grammar = _constraint_grammar(spec)
    if spec.reasoning in ("", "harmony_messages"):
        return grammar
    if spec.reasoning not in REASONING_MODES:
        raise InvalidRequestError(f"unknown reasoning mode {spec.reasoning!r}", param=spec.param)
    if spec.reasoning == "harmony":
        return xgr.Grammar.concat(_free_text_up_to("", HARMONY_FINAL), xgr.Grammar.from_ebnf(HARMONY_HEADER_END),
                                  grammar)
    thinking = _free_text_up_to("" if spec.reasoning == "inside" else THINK_START, THINK_END)
    after = xgr.Grammar.concat(thinking, xgr.Grammar.from_ebnf('root ::= [ \\t\\n\\r]{0,2}'), grammar)
    return after if spec.reasoning == "inside" else xgr.Grammar.union(after, grammar)


def _constraint_grammar(spec: GrammarSpec):
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        elif spec.kind == "json_object":  # any object, as OpenAI's JSON mode (the builtin grammar takes any value)
            grammar = xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        elif spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec.value)))
        elif spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.value)
        else:
            grammar = xgr.Grammar.from_structural_tag(spec.value)
        return json_strings_without_controls(grammar)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own errors
        raise InvalidRequestError(f"invalid {spec.kind}: {error_text(exc)}", param=spec.param) from None


class GrammarCompiler:
    """Compiles specs with xgrammar in worker threads; compiled grammars are cached by spec
    (xgrammar's own cache, bounded in bytes). Used by the front ends (to reject a spec that
    fails or takes longer than `timeout_s`) and by the engine core."""

    def __init__(self, model_path: str | Path, vocab_size: int, stop_token_ids: list[int],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, max_workers: int = 2):
        self.model_path, self.vocab_size, self.stop_token_ids = model_path, vocab_size, stop_token_ids
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        # xgrammar's compilers, by whether their vocabulary spells harmony's control tokens (reads_harmony)
        self._compilers: dict[bool, object] = {}
        self.utf8_tables: Utf8Tables | None = None  # with the first compiler
        self._lock = threading.Lock()
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()  # by spec, least recently used first
        self._compiled_bytes = 0

    @functools.cached_property
    def _views(self) -> tuple[bool, ...]:
        """The views of the vocabulary this model's grammars need (_xgr_compiler's `harmony`): the
        plain one, and the harmony one where harmony's markers are special tokens (gpt-oss)."""
        return (False, True) if set(HARMONY_MARKERS) <= special_token_texts(self.model_path) else (False,)

    @property
    def vocabulary_loaded(self) -> bool:
        """Whether xgrammar's views of the vocabulary have been built (warm, or the first compile of each)."""
        return all(harmony in self._compilers for harmony in self._views)

    def warm(self) -> None:
        """Read the vocabulary now, in a worker thread, rather than on the first request (servers): each
        view of it (a harmony one, ~2 s at gpt-oss's 200k tokens, only where the model writes harmony)."""
        self._pool.submit(lambda: [self._xgr_compiler(harmony) for harmony in self._views])

    def _xgr_compiler(self, harmony: bool = False):
        """xgrammar's compiler over the vocabulary; `harmony`: one whose vocabulary spells harmony's
        control tokens (a second one, built on the first harmony grammar)."""
        with self._lock:  # built on first use: the tokenizer's vocabulary takes a moment to read
            if harmony not in self._compilers:
                import xgrammar as xgr

                info = tokenizer_info(self.model_path, self.vocab_size, self.stop_token_ids,
                                      spelled=HARMONY_MARKERS if harmony else ())
                if self.utf8_tables is None:  # the same for both: harmony's markers hold no surrogate
                    self.utf8_tables = Utf8Tables(info.decoded_vocab, -(-self.vocab_size // 32))
                # xgrammar's own cache is off: it keys grammars by their printed text and compiles that
                # text read again, which xgrammar's printing can change (see reparse); ours keys by spec
                self._compilers[harmony] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compilers[harmony]

    def matcher(self, compiled) -> Utf8Matcher:
        """A matcher of a grammar this compiler compiled."""
        import xgrammar as xgr

        return Utf8Matcher(xgr.GrammarMatcher(compiled), self.utf8_tables)

    def compile(self, spec: GrammarSpec):
        """The compiled grammar (blocking; a worker thread calls it)."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        grammar = _grammar(spec)  # raises InvalidRequestError
        try:
            compiled = self._xgr_compiler(reads_harmony(spec)).compile_grammar(grammar)
        except Exception as exc:
            raise InvalidRequestError(f"invalid {spec.kind}: {error_text(exc)}", param=spec.param) from None
        with self._lock:
            if spec not in self._compiled:
                self._compiled[spec] = compiled
                self._compiled_bytes += compiled.memory_size_bytes
            while self._compiled_bytes > GRAMMAR_CACHE_BYTES and len(self._compiled) > 1:
                self._compiled_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes
        return compiled

    def submit(self, spec: GrammarSpec) -> Future:
        return self._pool.submit(self.compile, spec)

    async def check(self, spec: GrammarSpec) -> None:
        """Front end: raise InvalidRequestError if `spec` is malformed, does not compile, or
        does not compile within the time bound (its thread finishes in the background)."""
        import asyncio

        check_spec(spec)
        future = asyncio.wrap_future(self.submit(spec))
        try:
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            future.add_done_callback(lambda f: f.exception())  # retrieve it: nothing waits any more
            raise InvalidRequestError(f"the {spec.kind} took longer than {self.timeout_s:g}s to compile",
                                      param=spec.param) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
