"""PromptEncoder: long prompts are refused by length or tokenized off the event loop."""

from __future__ import annotations

import asyncio

import pytest

from router.domain import Exhausted, InvalidInput
from router.request.prompt_encoder import INLINE_CHARS, PromptEncoder
from workers.text.default_model import default_model_path
from workers.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(default_model_path())


def test_the_length_bound_never_refuses_a_text_that_fits(tokenizer: Tokenizer) -> None:
    # The worst case per token: the longest vocabulary entry, repeated until the context is full.
    longest = max(tokenizer._backend.get_vocab(True), key=len)
    text = tokenizer.decode([tokenizer._backend.token_to_id(longest)] * 100)
    per_token = len(text) / len(tokenizer.encode(text, add_special_tokens=False))
    assert per_token <= tokenizer.max_token_chars


def test_a_text_longer_than_the_context_can_spell_is_refused_before_tokenizing(
    tokenizer: Tokenizer,
) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=64)
    text = "x" * (encoder.max_chars + 1)
    with pytest.raises(InvalidInput, match=r"^prompt\.text has \d+ characters"):
        asyncio.run(encoder.encode(text, "prompt.text"))
    assert encoder.num_pending == 0
    encoder.close()


def test_long_texts_are_tokenized_on_threads_while_the_loop_runs(tokenizer: Tokenizer) -> None:
    encoder = PromptEncoder(tokenizer, max_model_len=1 << 20)
    text = "The quick brown fox jumps over the lazy dog. " * 20000  # ~0.9 MB: ~0.5 s of work

    async def run() -> tuple[list[int], int]:
        ticks = 0
        task = asyncio.ensure_future(encoder.encode(text, "prompt"))
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        return task.result(), ticks

    ids, ticks = asyncio.run(run())
    assert ids == tokenizer.encode(text)
    # Tokenized on the loop (or holding the GIL), the loop would not tick until it was done.
    assert ticks > 20
    encoder.close()


def test_short_texts_are_tokenized_inline_and_too_many_long_ones_are_refused(
    tokenizer: Tokenizer,
) -> None:
    long_text = "lorem ipsum dolor sit amet " * 20000
    encoder = PromptEncoder(
        tokenizer, max_model_len=1 << 20, threads=1, max_pending_chars=2 * len(long_text)
    )

    async def run() -> list[object]:
        first = [asyncio.ensure_future(encoder.encode(long_text, "p")) for _ in range(2)]
        await asyncio.sleep(0)  # both are on the pool now
        results: list[object] = []
        try:
            await encoder.encode(long_text, "p")
        except Exhausted as exc:
            results.append(exc)
        results.append(await encoder.encode("short" * (INLINE_CHARS // 10), "p"))
        results.extend(await asyncio.gather(*first))
        return results

    refused, short, *done = asyncio.run(run())
    assert isinstance(refused, Exhausted)
    assert short == tokenizer.encode("short" * (INLINE_CHARS // 10))
    assert all(ids == tokenizer.encode(long_text) for ids in done)
    assert encoder.num_pending == 0
    encoder.close()


def test_a_burst_of_ordinary_long_prompts_waits_its_turn_and_none_is_refused(
    tokenizer: Tokenizer,
) -> None:
    # 16 streams of ~1K-token prompts (~6,000 characters each), all at once: a load tool's
    # burst, which vLLM queues; a bound on their count refused half of them.
    encoder = PromptEncoder(tokenizer, max_model_len=4096)
    texts = [
        f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 140 for i in range(16)
    ]
    assert all(len(text) > INLINE_CHARS for text in texts)

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(encoder.encode(text, "prompt") for text in texts))

    assert asyncio.run(run()) == [tokenizer.encode(text) for text in texts]
    assert encoder.num_pending == 0 and encoder.pending_chars == 0
    encoder.close()
