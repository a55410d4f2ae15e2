"""Streaming text from generated token ids, one delta at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.text.tokenizer import TokenizerError

if TYPE_CHECKING:
    from workers.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing sequence of token ids into text deltas for streaming and stop strings.

    A token may end inside a multi-byte UTF-8 character; its text is held back until a later
    token completes it, so no delta ever ends in a partial character (U+FFFD). After `finish()`,
    the deltas joined equal `tokenizer.decode(all_ids)`.

    With a byte-level tokenizer (`Tokenizer.byte_pieces`) each id appends its bytes and the
    complete characters among them are the delta: no call into the tokenizer a token, where
    decoding windows cost two (~0.3 ms a step of 64 sequences). Otherwise each step decodes only
    a short window: the ids since the last emitted text, plus the ids of the previous delta as
    context, because some decoders treat the first token of a sequence specially (e.g.
    sentencepiece drops its leading space). Not thread-safe; one per request.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, byte_level: bool = True
    ) -> None:
        """`byte_level=False` decodes windows even where the tokenizer has byte pieces."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context ids whose text is already emitted
        self._read_offset = 0  # ids before this have had their text emitted
        self._text_parts: list[str] = []
        # The byte-level path: each id's bytes, and the bytes not yet emitted as text.
        self._pieces = tokenizer.byte_pieces if skip_special_tokens and byte_level else None
        self._pending = b""

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
        new_ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._ids.extend(new_ids)
        if self._pieces is not None:
            return self._add_bytes(new_ids, self._pieces)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        # Hold back while the newest bytes are an incomplete character; a real U+FFFD in the
        # text is held too, until the next token or finish().
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def finish(self) -> str:
        """Return whatever is held back (an incomplete character decodes as U+FFFD)."""
        if self._pieces is not None:
            text, self._pending = self._pending.decode(errors="replace"), b""
            return self._emit(text) if text else ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def _add_bytes(self, ids: Sequence[int], pieces: Sequence[bytes]) -> str:
        # The pending bytes always start a character: what went before was emitted whole.
        bad = next((i for i in ids if not 0 <= i < len(pieces)), None)
        if bad is not None:
            raise TokenizerError(f"token id {bad} is outside the vocabulary [0, {len(pieces)})")
        self._pending += b"".join(pieces[i] for i in ids)
        text = self._pending.decode(errors="replace")
        if not text or text.endswith(_REPLACEMENT):
            return ""  # held back, as the window path holds it
        self._pending = b""
        return self._emit(text)

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._text_parts.append(delta)
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start == end:
            return ""
        ids = self._ids[start:end]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
