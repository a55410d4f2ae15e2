"""Engine.score: one multi-item pass equals scoring each `prefix + item` alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.scoring import ScoreError


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model: Any, prefix: list[int], item: list[int], labels: list[int]) -> list[float]:
    with torch.inference_mode():
        logits = model(torch.tensor([prefix + item])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)[labels].tolist()


@pytest.mark.parametrize("prefix_len", [1, 8, 13])  # 8: block-aligned; 13 and 1: not
def test_score_equals_separate_requests(
    tiny_llama_dir: Path, tiny_hf_model: Any, prefix_len: int
) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=64))
    prefix = _ids(prefix_len, 1)
    items = [_ids(n, 10 + n) for n in (3, 1, 7, 4)]
    labels = [5, 17, 300]
    got = engine.score(prefix, items, labels)
    want = [_reference(tiny_hf_model, prefix, it, labels) for it in items]
    assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-4)
    assert engine.pool.num_free == 64
    engine.pool.check_integrity()


def test_score_leaves_the_engine_usable(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=64))
    from workers.sampling_params import SamplingParams

    before = engine.generate([_ids(9, 2)], SamplingParams(max_tokens=5, temperature=0.0))
    engine.score(_ids(9, 2), [_ids(3, 4)], [1])
    after = engine.generate([_ids(9, 2)], SamplingParams(max_tokens=5, temperature=0.0))
    assert before[0].token_ids == after[0].token_ids


@pytest.mark.parametrize(
    ("prefix", "items", "labels", "field"),
    [
        ([], [[1]], [1], "prefix"),
        ([1], [], [1], "items"),
        ([1], [[1], []], [1], r"items\[1\]"),
        ([1], [[1]], [], "label_token_ids"),
        ([1], [[999]], [1], r"items\[0\]"),
        ([1], [[1]], [-1], "label_token_ids"),
    ],
)
def test_bad_score_input_names_the_field(
    tiny_llama_dir: Path, prefix: Any, items: Any, labels: Any, field: str
) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=64))
    with pytest.raises(ScoreError, match=field):
        engine.score(prefix, items, labels)
    assert engine.pool.num_free == 64


def test_score_needs_enough_blocks(tiny_llama_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), block_size=4, num_blocks=3))
    with pytest.raises(ScoreError, match="blocks"):
        engine.score(_ids(8, 1), [_ids(6, 2), _ids(6, 3)], [1])
    assert engine.pool.num_free == 3
