"""Streaming text from generated token ids, one delta at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing sequence of token ids into text deltas for streaming and stop strings.

    A token may end inside a multi-byte UTF-8 character; its text is held back until a later
    token completes it, so no delta ever ends in a partial character (U+FFFD). After `finish()`,
    the deltas joined equal `tokenizer.decode(all_ids)`.

    Each step decodes only a short window: the ids since the last emitted text, plus the ids of
    the previous delta as context, because some decoders treat the first token of a sequence
    specially (e.g. sentencepiece drops its leading space). Not thread-safe; one per request.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context ids whose text is already emitted
        self._read_offset = 0  # ids before this have had their text emitted
        self._text_parts: list[str] = []

    @property
    def token_ids(self) -> list[int]:
        """Every id fed so far (a copy)."""
        return list(self._ids)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text_parts)

    def add(self, token_ids: int | Sequence[int]) -> str:
        """Feed one id or several; return the newly complete text (may be empty)."""
        self._ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        # Hold back while the newest bytes are an incomplete character; a real U+FFFD in the
        # text is held too, until the next token or finish().
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def finish(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text_parts.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        ids = self._ids[start:end]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
