"""The model's tokenizer (the `tokenizers` library) and its Jinja chat template."""

from __future__ import annotations

import functools
import json
from datetime import datetime
import re
import secrets
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from graphserve.engine.errors import InvalidRequestError, ModelFilesError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelFilesError(f"{path} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(tok_file))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt tokenized in a worker
        # thread then does not stall the event loop
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    @functools.cached_property
    def special_tokens(self) -> dict[str, int]:
        """The text of each special (control) token -> its id."""
        return {tok.content: i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special}

    @functools.cached_property
    def special_token_pattern(self) -> re.Pattern[str] | None:
        """Finds the text of any special token (longest first at each position)."""
        if not self.special_tokens:
            return None
        return re.compile("|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)))

    @functools.cached_property
    def _text_tok(self) -> HFTokenizer:
        """A copy that splits special-token text like any other text (its own object:
        flipping encode_special_tokens on the shared one would race with other threads)."""
        tok = HFTokenizer.from_str(self._tok.to_str())
        tok.encode_special_tokens = True
        return tok

    def encode_as_text(self, text: str) -> list[int]:
        """Tokenize with special-token text kept as ordinary text (no BOS/EOS added)."""
        return self._text_tok.encode(text, add_special_tokens=False).ids

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Render the chat template and tokenize it so that only the template's own markup
        becomes control tokens: special-token text inside a message's content or name
        stays text. Messages without such text give exactly encode(render) (the ids of
        plain rendering and tokenizing).

        Otherwise only the special-token texts inside contents are swapped for markers
        before rendering (so templates that trim or inspect contents still see them
        nearly whole), the rendered text is tokenized as usual, and each run of text
        between two of the template's control tokens that holds a marker is tokenized
        again with the markers' texts put back, as text. Runs without content special
        text keep exactly the ids they had."""
        pattern = self.special_token_pattern
        fields = ("content", "name", "tool_calls")  # tool calls: every string inside them
        render = functools.partial(self.apply_chat_template, add_generation_prompt=add_generation_prompt, tools=tools,
                                   template_kwargs=template_kwargs)
        if pattern is None or not any(_any_string(m.get(f), pattern.search) for m in messages for f in fields):
            return self.encode(render(messages), add_special_tokens=False)
        # Each special-token text in a content becomes a marker no client can guess, so
        # that the only control tokens in the rendered text are the template's.
        nonce = secrets.token_hex(8)
        found: list[str] = []

        def mark(m: re.Match[str]) -> str:
            found.append(m.group())
            return f"\ue000{nonce}.{len(found) - 1}\ue001"

        marked = [{k: _map_strings(v, lambda t: pattern.sub(mark, t)) if k in fields else v for k, v in m.items()}
                  for m in messages]
        text = render(marked)
        marker = re.compile(f"\ue000{nonce}\\.(\\d+)\ue001")
        restored = marker.sub(lambda m: found[int(m.group(1))], text)
        if restored != render(messages):
            # the template rewrote the characters of a content (upper, a slice...) or
            # branched on its special-token text: the two cannot be told apart safely
            raise InvalidRequestError("the chat template transforms message content that holds special-token "
                                      "text; remove that text from the messages", param="messages")
        enc = self._tok.encode_batch([text], add_special_tokens=False)[0]
        special_ids = set(self.special_tokens.values())
        ids: list[int] = []
        seg_start, seg_tok = 0, 0  # the text and tokens since the last template control token
        for i, (tid, (start, end)) in enumerate([*zip(enc.ids, enc.offsets), (None, (len(text), len(text)))]):
            if tid is not None and tid not in special_ids:
                continue
            segment = text[seg_start:start]
            if marker.search(segment):  # content text: re-tokenize as text, specials included
                ids += self.encode_as_text(marker.sub(lambda m: found[int(m.group(1))], segment))
            else:
                ids += enc.ids[seg_tok:i]
            if tid is not None:
                ids.append(tid)
            seg_start, seg_tok = end, i + 1
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object underneath (the detokenizer's decode stream steps over it)."""
        return self._tok

    @functools.cached_property
    def byte_of_symbol(self) -> dict[str, int] | None:
        """A ByteLevel vocabulary (GPT-2's scheme) spells each byte as one printable symbol:
        symbol -> byte. None under other decoders."""
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        return {symbol: byte for byte, symbol in _bytes_to_unicode().items()}

    @functools.cached_property
    def added_token_ids(self) -> frozenset[int]:
        """The ids of the added tokens (special or not): each decodes to its own text."""
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs): decoded, specials kept."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> str:
        """`template_kwargs`: extra variables for the template (a request's chat_template_kwargs,
        e.g. enable_thinking); they cannot replace the ones set here."""
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = _strftime_now  # gpt-oss's (harmony) template writes the date
            env.filters["tojson"] = _tojson  # as transformers renders templates: no HTML escaping
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render({**(template_kwargs or {}), "messages": messages,
                                          "add_generation_prompt": add_generation_prompt,
                                          "bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                                          **({"tools": tools} if tools else {})})
        except Exception as e:  # the template compiled, so a render failure follows from these messages
            raise InvalidRequestError(f"chat template failed: {e}", param="messages") from e


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map, which the ByteLevel decoder inverts."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:
    """The local date and time in `format`, as transformers gives templates."""
    return datetime.now().strftime(format)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _map_strings(value: Any, fn) -> Any:
    """`value` with fn applied to every string in it (dicts and lists walked)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


def _any_string(value: Any, predicate) -> bool:
    if isinstance(value, str):
        return bool(predicate(value))
    if isinstance(value, dict):
        return any(_any_string(v, predicate) for v in value.values())
    if isinstance(value, list):
        return any(_any_string(v, predicate) for v in value)
    return False
