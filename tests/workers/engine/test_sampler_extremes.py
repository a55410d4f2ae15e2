"""Extreme but valid temperatures sample without NaN (found by fuzzing the router)."""

from __future__ import annotations

import torch

from workers.engine.sampler import sample
from workers.sampling_params import SamplingParams


def test_tiny_temperature_is_greedy_and_huge_is_finite() -> None:
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=1.4e-45),  # the smallest float32 above zero
        SamplingParams(temperature=1e-30, top_k=5, top_p=0.5),
        SamplingParams(temperature=3e38, top_p=0.9),
    ]
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens = sample(logits, params, gens)
    assert tokens[:2] == logits[:2].argmax(dim=-1).tolist()
    assert 0 <= tokens[2] < 64
