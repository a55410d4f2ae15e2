"""ModelConfig.max_context_len: the RoPE table's length, capped at a sliding window (attention
here has no window, so no sequence may pass it)."""

from __future__ import annotations

from typing import Any

import pytest

from workers.model.config import ModelConfig, ModelLoadError

BASE: dict[str, Any] = {
    "model_type": "mistral",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    ("change", "context_len"),
    [
        ({"sliding_window": None}, 128),
        ({"sliding_window": 48}, 48),
        ({"sliding_window": 4096}, 128),  # a window wider than the positions changes nothing
        ({"model_type": "llama"}, 128),
        ({"model_type": "qwen2", "sliding_window": 48}, 128),  # use_sliding_window is off
        ({"model_type": "qwen2", "sliding_window": 48, "use_sliding_window": True}, 48),
    ],
)
def test_sliding_window_caps_the_context(change: dict[str, Any], context_len: int) -> None:
    assert ModelConfig.from_hf_dict({**BASE, **change}).max_context_len == context_len


def test_a_window_must_be_positive() -> None:
    with pytest.raises(ModelLoadError, match="sliding_window"):
        ModelConfig.from_hf_dict({**BASE, "sliding_window": 0})
