"""A coalescing stream that fell behind the steps: fewer items, the same tokens and text, in
order, ending as the stream without coalescing ends."""

from __future__ import annotations

import asyncio

import pytest

from workers.config import EngineConfig
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.engine.outputs import RequestOutput
from workers.model.tiny import WordTokenizer, write_tiny_model
from workers.sampling_params import SamplingParams

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 14, 3, 22, 7]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    tokenizer = WordTokenizer(
        words=WORDS, special=["[UNK]", "<s>", "</s>"], unk="[UNK]", eos="</s>"
    )
    path = write_tiny_model(
        tmp_path_factory.mktemp("tiny-words"), vocab_size=48, tokenizer=tokenizer
    )
    return Engine(EngineConfig(model=str(path), block_size=4, num_blocks=64))


async def _read(engine: AsyncEngine, coalesce: bool, lag_steps: bool) -> list[RequestOutput]:
    """Every item of one stream; with `lag_steps`, the reader first waits for the request to
    finish in the engine (every step's snapshot is queued by then)."""
    items: list[RequestOutput] = []
    async for out in engine.generate(PROMPT, PARAMS, "r", coalesce=coalesce):
        items.append(out)
        if lag_steps and len(items) == 1:
            # Until the last step's outputs are queued: the step's thread is done with the
            # request before the loop queues them (it does so as it leaves `_busy`).
            while engine.engine.has_unfinished() or engine._busy:
                await asyncio.sleep(0.01)
    return items


def test_a_late_reader_gets_one_item_with_everything_it_missed(engine: Engine) -> None:
    async def both() -> tuple[list[RequestOutput], list[RequestOutput]]:
        front = AsyncEngine(engine)
        plain = await _read(front, coalesce=False, lag_steps=True)
        merged = await _read(front, coalesce=True, lag_steps=True)
        await front.shutdown()
        return plain, merged

    plain, merged = asyncio.run(both())
    assert len(plain) == PARAMS.max_tokens  # without coalescing: one item a step
    assert len(merged) == 2  # the first, then the backlog as one
    final = merged[-1]
    assert final.finished and final.finish_reason == "length"
    assert final.token_ids == plain[-1].token_ids and final.text == plain[-1].text
    assert final.text  # the words decode to text, so the deltas carry something
    assert "".join(out.delta_text for out in merged) == final.text
    assert "".join(out.delta_text for out in plain) == final.text


def test_a_reader_that_keeps_up_loses_and_repeats_nothing(engine: Engine) -> None:
    async def run() -> list[RequestOutput]:
        front = AsyncEngine(engine)
        items = await _read(front, coalesce=True, lag_steps=False)
        await front.shutdown()
        return items

    items = asyncio.run(run())
    lengths = [len(out.token_ids) for out in items]
    # As many items as the reader was ready for (every step, unless a step overtook it).
    assert lengths == sorted(set(lengths)) and lengths[-1] == PARAMS.max_tokens
    assert "".join(out.delta_text for out in items) == items[-1].text
