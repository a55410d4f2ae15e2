"""Sampler: greedy, seeds, top-k and top-p filters."""

import torch

from workers.engine.sampler import _top_p_filter, sample
from workers.sampling_params import SamplingParams


def _logits(rows: int = 3, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=0.0)] * 3
    assert sample(logits, params, [None] * 3) == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy() -> None:
    logits = _logits()
    params = [SamplingParams(temperature=1.5, top_k=1)] * 3
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch() -> None:
    logits = _logits(4)
    p = SamplingParams(temperature=1.0, seed=3)

    def draw(rows: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(3) for _ in rows]
        return sample(logits[rows], [p] * len(rows), gens)

    alone = draw([2])
    assert draw([2]) == alone
    assert draw([0, 1, 2])[2] == alone[0]


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(_top_p_filter(logits, 0.7))
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(_top_p_filter(logits, 0.5))
    assert kept.tolist() == [True, False, False, False]


def test_sampling_respects_top_k_support() -> None:
    logits = _logits(1, 100)[0]
    p = SamplingParams(temperature=2.0, top_k=5)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    gen = torch.Generator().manual_seed(1)
    draws = {sample(logits[None], [p], [gen])[0] for _ in range(50)}
    assert draws <= allowed and len(draws) > 1
