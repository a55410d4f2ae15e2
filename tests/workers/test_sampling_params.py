"""SamplingParams is the one place both doors validate sampling numbers: every value it accepts
is one the engine's arithmetic survives, and a refusal names the field it is about."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.beam import length_score
from workers.engine.sampler import _top_p_filter, sample, token_seed
from workers.sampling_params import GREEDY_BELOW, SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("length_penalty", 1e308),
        ("length_penalty", -1e308),
        ("length_penalty", math.inf),
        ("length_penalty", -math.inf),
        ("length_penalty", math.nan),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", -1.0),
        ("top_p", 1e-300),  # 0 in float32: no token would be kept
        ("top_p", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("max_tokens", 0),
        ("max_tokens", 2**31),
        ("max_tokens", True),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("output_offset", -1),
        ("output_offset", 2**63),
        ("n", 0),
        ("beam_width", 33),
        ("stop_token_ids", (1, "x")),
    ],
)
def test_refusal_names_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    # The doors turn the message into a 400 / INVALID_ARGUMENT whose param is its first word.
    assert str(info.value).startswith(f"{field} "), str(info.value)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, GREEDY_BELOW / 2])
def test_a_temperature_below_the_floor_is_greedy(temperature: float) -> None:
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=3, seed=1)
    assert params.greedy and params.temperature == 0.0


def test_extremes_that_stay_valid() -> None:
    SamplingParams(temperature=GREEDY_BELOW, top_p=1.4e-45, top_k=2**40, max_tokens=2**31 - 1)
    SamplingParams(seed=-(2**63), length_penalty=-100.0, beam_width=2)
    SamplingParams(seed=2**64 - 1, length_penalty=100.0, output_offset=2**63 - 1)


def test_sample_seeds_wrap_to_64_bits_and_draw_the_same() -> None:
    params = SamplingParams(seed=2**64 - 1, n=3)
    wrapped = params.for_sample(2)
    assert wrapped.seed == 1
    assert token_seed(wrapped.seed, 5) == token_seed(2**64 + 1, 5)


@pytest.mark.parametrize("length_penalty", [-100.0, -1.0, 0.0, 1.0, 100.0])
@pytest.mark.parametrize("length", [1, 2, 10**4, 10**7])
def test_beam_scores_never_overflow(length_penalty: float, length: int) -> None:
    scores = [length_score(cum, length, length_penalty) for cum in (-1e4, -3.0, -1e-9, 0.0)]
    assert not any(math.isnan(s) for s in scores)
    # The order of the log-probs survives whatever the scale (ties only where it saturates).
    assert scores == sorted(scores)
    assert length_score(0.0, length, length_penalty) == 0.0


def test_beam_score_is_hugging_faces_where_it_is_finite() -> None:
    assert length_score(-6.0, 4, 1.0) == pytest.approx(-1.5)
    assert length_score(-6.0, 4, 2.0) == pytest.approx(-6.0 / 16)
    assert length_score(-6.0, 4, -1.0) == pytest.approx(-24.0)


def test_top_p_that_is_zero_in_float32_still_keeps_the_top_token() -> None:
    logits = torch.log(torch.tensor([0.2, 0.5, 0.3]))
    assert torch.isfinite(_top_p_filter(logits, 1e-300)).tolist() == [False, True, False]


def test_a_huge_temperature_over_extreme_logits_draws_without_nan() -> None:
    logits = torch.tensor([[3.0e38, -3.0e38, 0.0]])  # their spread is -inf in float32
    gen = torch.Generator().manual_seed(0)
    [token] = sample(logits, [SamplingParams(temperature=1e300)], [gen])
    assert token in (0, 2)


_finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@settings(deadline=None, max_examples=150)
@given(
    temperature=st.one_of(st.floats(0, 1e300), st.sampled_from([1e-300, 1e-5, 3.4e38, 1e308])),
    top_p=st.one_of(st.floats(1e-45, 1.0), st.sampled_from([1.4e-45, 1e-30, 1.0])),
    top_k=st.integers(-1, 400),
    row=st.lists(_finite, min_size=2, max_size=40),
    seed=st.integers(-(2**63), 2**64 - 1),
)
def test_valid_params_always_sample_a_token(
    temperature: float, top_p: float, top_k: int, row: list[float], seed: int
) -> None:
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError:
        return  # refused: never reaches the sampler
    logits = torch.tensor([row], dtype=torch.float32)
    gen = torch.Generator().manual_seed(token_seed(seed, 0))
    [token] = sample(logits, [params], [gen])
    assert 0 <= token < len(row)
    if params.greedy or top_k == 1:
        assert token == int(logits[0].argmax())
