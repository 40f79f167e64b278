"""Incremental detokenization for streaming: new text per token, never splitting a UTF-8 character.

Decoding a short window of recent tokens (not the whole output) keeps each step O(1); the window
starts a few tokens back so tokenizers that merge spaces across token boundaries decode correctly.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 5  # tokens of left context kept when decoding the newest ones


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0  # start of the decode window in self.ids
        self.read_offset = len(self.ids)  # tokens before this are already emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        out: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return out

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be '' while a character is incomplete)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += new
        return new

    def flush(self) -> str:
        """At the end of a request: emit whatever is still held back."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        new = full[len(prefix) :]
        self.read_offset = len(self.ids)
        self.text += new
        return new
