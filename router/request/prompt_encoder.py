"""Token ids of prompt text, without stalling the router's event loop.

A prompt near the message size limit takes seconds to tokenize; on the event loop that would
stall health checks, metrics and every other stream. So:

- a text too long to fit the model's context is refused by its length alone, before any
  tokenizing: a token never stands for more than `max_token_chars` characters of text (the
  longest vocabulary entry), so a longer text has more tokens than the context holds;
- a short text is tokenized inline (cheaper than a thread hop);
- a long one goes to a small thread pool (`Tokenizer.encode` releases the GIL) and waits its
  turn there, as in vLLM's async tokenizer: a burst of ordinary long prompts (16 streams of
  ~1K-token prompts) is queued, never refused. Only when the texts waiting already hold
  `max_pending_chars` characters (seconds of tokenizing) is a request refused as exhausted
  (retryable): that bounds the memory and the wait a flood of huge prompts can cause.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from router.domain import Exhausted, InvalidInput
from workers.text.tokenizer import Tokenizer, TokenizerError

# Up to this many characters a text is tokenized on the event loop (well under a millisecond).
INLINE_CHARS = 4096
# Characters of long texts that may wait for the pool at once: two threads tokenize about
# 1-2 MB/s each, so this is a few seconds of work, and two prompts at the message size limit.
MAX_PENDING_CHARS = 8 << 20
# NFKC-style normalizers may compose characters (e + combining accent -> é): allow the text to
# be longer than the normalized text its tokens spell.
_NORMALIZE_MARGIN = 2


class PromptEncoder:
    """Encodes text for one tokenizer and context length; owns its thread pool (`close`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        threads: int = 2,
        max_pending_chars: int = MAX_PENDING_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_chars = max_model_len * tokenizer.max_token_chars * _NORMALIZE_MARGIN
        self.max_model_len = max_model_len
        self.max_pending_chars = max_pending_chars
        self.num_pending = 0
        self.pending_chars = 0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    async def encode(self, text: str, field: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; raises InvalidInput naming `field` for a text that cannot fit
        the context (or that the tokenizer refuses), Exhausted when the long texts waiting
        already hold `max_pending_chars` characters (one text alone is always taken)."""
        if len(text) > self.max_chars:
            raise InvalidInput(
                f"{field} has {len(text)} characters, more than {self.max_model_len} tokens "
                f"(the model's context) can spell; shorten it"
            )
        if len(text) <= INLINE_CHARS:
            return self._encode(text, field, add_special_tokens)
        if self.num_pending and self.pending_chars + len(text) > self.max_pending_chars:
            raise Exhausted(
                f"the router is tokenizing {self.num_pending} long prompts "
                f"({self.pending_chars} characters) already; retry later"
            )
        self.num_pending += 1
        self.pending_chars += len(text)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool, self._encode, text, field, add_special_tokens
            )
        finally:
            self.num_pending -= 1
            self.pending_chars -= len(text)

    def close(self) -> None:
        """Stop the thread pool (texts being tokenized finish first)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, text: str, field: str, add_special_tokens: bool) -> list[int]:
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except TokenizerError as exc:
            raise InvalidInput(f"{field}: {exc}") from exc
