"""What xgrammar sees of the vocabulary, so that the text a client receives is exactly the
text the grammar accepted.

Three ways the two could differ, each closed here:
- Special tokens. The detokenizer drops them, but xgrammar reads their spelling
  ("<|begin_of_text|>") as ordinary text. Every special token other than a stop token is
  given an empty spelling, which xgrammar never allows; except, for a grammar of gpt-oss's
  harmony format, harmony's markers: its requests keep special tokens in their text.
- Surrogates. xgrammar's UTF-8 decoding takes ED A0-BF xx (U+D800-DFFF, invalid in UTF-8)
  as a character, and the detokenizer turns those bytes into U+FFFD. A token holding such a
  sequence is never allowed; after a token that ends in a bare ED lead byte, Utf8Matcher
  forbids the tokens that begin with A0-BF. (Overlong forms, lone continuation bytes and
  code points past U+10FFFF xgrammar rejects itself.)
- Raw control characters in JSON strings: see grammar.json_strings_without_controls."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import numpy as np
import torch

SURROGATE_LEAD = 0xED  # ED A0-BF is U+D800-DFFF; ED 80-9F is Hangul and other valid text


def _has_surrogate(data: bytes) -> bool:
    start = data.find(SURROGATE_LEAD)
    while start != -1:
        if start + 1 < len(data) and 0xA0 <= data[start + 1] <= 0xBF:
            return True
        start = data.find(SURROGATE_LEAD, start + 1)
    return False


class Utf8Tables:
    """Per-token facts the matcher needs: which tokens end in a bare ED lead byte, and the
    bitmask (int32 words, bit set = allowed) that forbids the tokens beginning with A0-BF."""

    def __init__(self, decoded_vocab: list[bytes], words: int):
        self.ends_in_lead = np.zeros(len(decoded_vocab), dtype=np.bool_)
        bits = np.ones(words * 32, dtype=np.bool_)
        for token_id, data in enumerate(decoded_vocab):
            if data:
                self.ends_in_lead[token_id] = data[-1] == SURROGATE_LEAD
                if 0xA0 <= data[0] <= 0xBF:
                    bits[token_id] = False
        self.after_lead = np.packbits(bits, bitorder="little").view(np.int32)


class Utf8Matcher:
    """An xgrammar GrammarMatcher whose next-token masks never let a surrogate through; the
    same calls as the matcher it wraps (those StructuredOutputs makes)."""

    def __init__(self, matcher, tables: Utf8Tables):
        self._matcher, self._tables = matcher, tables
        self._ends_in_lead = [False]  # per accepted token, for rollback

    def accept_token(self, token_id: int) -> bool:
        accepted = self._matcher.accept_token(token_id)
        if accepted:
            lead = token_id < len(self._tables.ends_in_lead) and bool(self._tables.ends_in_lead[token_id])
            self._ends_in_lead.append(lead)
            if len(self._ends_in_lead) > 1024:  # rollbacks reach back one round at most
                del self._ends_in_lead[:512]
        return accepted

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)
        if num_tokens:
            del self._ends_in_lead[-num_tokens:]
        if not self._ends_in_lead:
            self._ends_in_lead.append(False)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, index)
        if self._ends_in_lead[-1]:
            row = bitmask[index].numpy()
            row &= self._tables.after_lead[: row.shape[0]]

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


def special_token_texts(model_path: str | Path) -> frozenset[str]:
    """The texts of the tokenizer's special tokens."""
    from tokenizers import Tokenizer

    added = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json")).get_added_tokens_decoder()
    return frozenset(token.content for token in added.values() if token.special)


def tokenizer_info(model_path: str | Path, vocab_size: int, stop_token_ids: list[int], spelled: Collection[str] = ()):
    """xgrammar's view of the tokenizer: every id's spelling, with the model's logits width
    (padding ids beyond the tokenizer are never allowed) and its end-of-sequence ids. Special
    tokens other than the stop ids and those whose text is in `spelled` (harmony's markers, for a
    request that keeps them in its text), and tokens that hold a surrogate, get an empty spelling:
    xgrammar never allows those."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_path) / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    encoded = [""] * vocab_size
    for spelling, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = spelling
    stops = set(stop_token_ids)
    banned = {token_id for token_id, added in tokenizer.backend_tokenizer.get_added_tokens_decoder().items()
              if added.special and token_id not in stops and added.content not in spelled}
    banned.update(token_id for token_id, data in enumerate(info.decoded_vocab)
                  if SURROGATE_LEAD in data and _has_surrogate(data))
    if not banned:
        return info
    for token_id in banned:
        if token_id < vocab_size:
            encoded[token_id] = ""
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())
