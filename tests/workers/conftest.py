"""Fixtures for engine tests: a tiny random Llama saved as safetensors, greedy references, and
engines of it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from cachesvc.kv.config import TierConfig
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.model.tiny import write_tiny_model


def hf_greedy(model: Any, prompt: Sequence[int], num_tokens: int) -> list[int]:
    """Greedy continuation by Hugging Face transformers with its own KV cache, never stopping."""
    out: list[int] = []
    ids = torch.tensor([list(prompt)])
    past = None
    with torch.inference_mode():
        for _ in range(num_tokens):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="session", name="hf_greedy")
def hf_greedy_fixture() -> Any:
    return hf_greedy


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


# The two fixtures below take the block size and the sampling of the module that uses them (its
# `BS` and `GREEDY`): its engines and its references must agree on both.


@pytest.fixture(scope="module")
def expected(
    request: pytest.FixtureRequest, tiny_llama_dir: Path
) -> Callable[[list[int]], list[int]]:
    """Greedy tokens of an engine with no prefix cache at all."""
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama_dir),
            block_size=request.module.BS,
            num_blocks=64,
            enable_prefix_caching=False,
        )
    )
    return lambda prompt: list(engine.generate([prompt], request.module.GREEDY)[0].token_ids)


@pytest.fixture
def new_engine(request: pytest.FixtureRequest) -> Callable[..., Engine]:
    """`new_engine(path, tiers=None, num_blocks=64)`: an engine of the model at `path`, with the
    prefix cache on and these tiers (none by default)."""

    def make(path: Path, tiers: TierConfig | None = None, num_blocks: int = 64) -> Engine:
        config = EngineConfig(
            model=str(path),
            block_size=request.module.BS,
            num_blocks=num_blocks,
            tiers=tiers or TierConfig(),
        )
        return Engine(config)

    return make
