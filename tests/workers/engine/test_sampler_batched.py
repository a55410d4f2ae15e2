"""The batched draw of unseeded rows against the row-by-row distribution it replaced, and a
batch that mixes greedy, seeded and unseeded rows."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.sampler import argmax_rows, batch_probs, row_probs, sample, sample_each
from workers.sampling_params import SamplingParams

params_st = st.builds(
    SamplingParams,
    temperature=st.sampled_from([1e-3, 0.3, 1.0, 2.5, 3e38]),
    top_k=st.sampled_from([0, 1, 3, 40, 64, 100]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-9]),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(params_st, min_size=1, max_size=6), st.integers(0, 2**31))
def test_batched_probabilities_equal_each_rows_own(params: list[SamplingParams], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(params), 64, generator=gen) * 4
    logits[:, 7] = logits[:, 3]  # a tie, where top-k keeps both
    batched = batch_probs(logits, params)
    for row, p in enumerate(params):
        alone = row_probs(logits[row], p)
        # The same tokens kept, the same distribution over them.
        assert torch.equal(batched[row] > 0, alone > 0)
        torch.testing.assert_close(batched[row], alone, rtol=1e-5, atol=1e-7)


def test_mixed_batch_greedy_rows_argmax_seeded_rows_as_alone_unseeded_within_top_k() -> None:
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0)) * 3
    greedy = SamplingParams(temperature=0.0)
    seeded = SamplingParams(temperature=1.0, seed=11)
    top5 = SamplingParams(temperature=2.0, top_k=5)
    params = [greedy, top5, seeded, top5, greedy, top5]

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(11) if p is seeded else None for p in params]

    alone = sample(logits[2:3], [seeded], [torch.Generator().manual_seed(11)])[0]
    draws = [sample(logits, params, gens()) for _ in range(30)]
    argmax = logits.argmax(dim=-1).tolist()
    for tokens in draws:
        assert tokens[0] == argmax[0] and tokens[4] == argmax[4]
        assert tokens[2] == alone
        for row in (1, 3, 5):
            assert tokens[row] in set(torch.topk(logits[row], 5).indices.tolist())
    # Unseeded rows draw, not pick the top token each time.
    assert len({tokens[1] for tokens in draws}) > 1


def test_a_row_that_breaks_the_batched_draw_fails_alone() -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    logits[1] = float("nan")  # no distribution to draw from: multinomial raises
    unseeded = SamplingParams(temperature=1.0, top_k=1)  # top-1: the draw is the argmax
    tokens = sample_each(logits, [unseeded] * 4, [None] * 4)
    assert isinstance(tokens[1], RuntimeError)
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[row] for row in (0, 2, 3)] == [argmax[row] for row in (0, 2, 3)]


def test_argmax_rows_takes_the_first_of_equal_maxima_as_torch_does() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randint(-3, 4, (64, 500), generator=gen).float()  # many ties per row
    logits[3, 10:] = float("-inf")
    logits[4] = float("-inf")  # a row of nothing but -inf: its first index
    assert argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(dim=-1).tolist()  # a strided view
    assert argmax_rows(logits.double()) == logits.argmax(dim=-1).tolist()
