"""Incremental detokenizer: generated ids in, text deltas out, one token at a time.

Works on bytes: each token contributes its UTF-8 bytes (`Tokenizer.token_bytes`) to an incremental
UTF-8 decoder, which holds back a character whose bytes are split across tokens (an emoji is often
3-4 byte-level tokens) and releases it whole. So no delta ever ends in half a character, and the
concatenated deltas equal `tokenizer.decode(ids)`.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from .tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_leading_space = tokenizer.strips_leading_space
        self._emitted_any = False

    def add(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still incomplete)."""
        if token_id in self._skip:
            return ""
        return self._emit(self._utf8.decode(self._tokenizer.token_bytes(token_id)))

    def add_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.add(i) for i in token_ids)

    def flush(self) -> str:
        """At the end of generation: bytes of an unfinished character become U+FFFD."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and not self._emitted_any:
            self._emitted_any = True
            if self._strip_leading_space and text.startswith(" "):
                text = text[1:]
        return text
