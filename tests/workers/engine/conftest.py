"""Fixtures for engine tests: a tiny random Llama saved as safetensors, and greedy references."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

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
