"""SmolLM2 through the engine gives Hugging Face's greedy tokens on every scheduling path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
TEXTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "woodcutter and his three children. Every morning he",
    "Q: What is 17 times 3?\nA:",
    "Les chats sont",
    "List three primary colors:",
    "In 1969, the first humans landed on the Moon. The mission was called",
    "Hello",
)


@pytest.fixture(scope="module")
def loaded() -> Any:
    from workers.model.loader import load_model

    return load_model(None)


@pytest.fixture(scope="module")
def tokenizer(loaded: Any) -> Any:
    from workers.text.tokenizer import Tokenizer

    return Tokenizer.from_path(loaded.path)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in TEXTS[:3]]
    return [tokenizer.encode(t) for t in (*chat, *TEXTS[3:])]


@pytest.fixture(scope="module")
def reference(loaded: Any, prompts: list[list[int]], hf_greedy: Any) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        loaded.path.parent, gguf_file=loaded.path.name, dtype=torch.float32
    ).eval()
    return [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]


GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 24},
        {"enable_chunked_prefill": False},
        {"num_blocks": 24},  # 8 requests need ~40 blocks of 16: forces preemption
    ],
    ids=["batch", "chunked", "unchunked", "preempt"],
)
def test_batched_greedy_matches_hf(
    loaded: Any, tokenizer: Any, prompts: list[list[int]], reference: list[list[int]], kw: Any
) -> None:
    kw.setdefault("num_blocks", 512)
    engine = Engine(EngineConfig(**kw), loaded=loaded, tokenizer=tokenizer)
    outs = engine.generate(prompts, GREEDY)
    assert [list(o.token_ids) for o in outs] == reference
    if kw["num_blocks"] == 24:
        assert sum(o.num_preemptions for o in outs) > 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_one_at_a_time_matches_hf(
    loaded: Any, tokenizer: Any, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    engine = Engine(EngineConfig(num_blocks=512), loaded=loaded, tokenizer=tokenizer)
    for prompt, ref in zip(prompts, reference, strict=True):
        [out] = engine.generate([prompt], GREEDY)
        assert list(out.token_ids) == ref
    assert engine.pool.num_free == engine.pool.num_blocks


def test_chat_answer_is_text(loaded: Any, tokenizer: Any) -> None:
    engine = Engine(EngineConfig(num_blocks=128), loaded=loaded, tokenizer=tokenizer)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    [out] = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))
    assert out.text.strip() and out.text == tokenizer.decode(list(out.token_ids))
    assert out.finish_reason in ("stop", "length")
