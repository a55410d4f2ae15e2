"""A model with a sliding window: the engine keeps every sequence within the window (where full
attention equals windowed attention), so its tokens equal Hugging Face's windowed model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.engine import Engine, PromptError
from workers.model.tiny import write_tiny_model
from workers.sampling_params import SamplingParams

WINDOW = 16


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), architecture="mistral")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": WINDOW}))
    return folder


def test_context_stops_at_the_window(windowed_dir: Path, hf_greedy: Any) -> None:
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(model=str(windowed_dir), block_size=4, num_blocks=32))
    assert engine.max_model_len == WINDOW
    with pytest.raises(PromptError, match=str(WINDOW)):
        engine.encode_prompt(list(range(3, 3 + WINDOW)))
    prompt = torch.randint(0, 320, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    [out] = engine.generate([prompt], params)
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == WINDOW
    hf = AutoModelForCausalLM.from_pretrained(windowed_dir, dtype=torch.float32).eval()
    assert list(out.token_ids) == hf_greedy(hf, prompt, WINDOW - len(prompt))
