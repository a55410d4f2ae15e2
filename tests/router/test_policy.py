"""Routing policies as tables of cases: who gets the request, and why."""

from __future__ import annotations

import pytest

from cachesvc.index import PrefixMatch
from cachesvc.types import WorkerId
from router.policy import (
    Candidate,
    PrefixAware,
    RouteRequest,
    estimated_cost,
    make_policy,
    policy_names,
)

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
REQ = RouteRequest(num_prompt_tokens=64, block_size=16)


def _c(
    worker: WorkerId, requests: int = 0, queued: int = 0, blocks: dict[str, int] | None = None
) -> Candidate:
    match = None if blocks is None else PrefixMatch(worker, sum(blocks.values()), blocks)
    return Candidate(worker, requests, queued, match)


@pytest.mark.parametrize(
    ("candidates", "expected", "why"),
    [
        ([_c(W0), _c(W1, blocks={"hbm": 3})], W1, "a cached prefix wins on idle workers"),
        ([_c(W0, blocks={"hbm": 1}), _c(W1, blocks={"hbm": 3})], W1, "the longer prefix wins"),
        (
            [_c(W0, requests=2, queued=200), _c(W1, blocks={"hbm": 3})],
            W1,
            "cached and idle beats busy",
        ),
        (
            [_c(W0, requests=1, queued=500, blocks={"hbm": 4}), _c(W1, requests=1, queued=10)],
            W1,
            "a long queue outweighs the cached prefix",
        ),
        (
            [_c(W0, blocks={"nvme": 3}), _c(W1, blocks={"hbm": 3})],
            W1,
            "the same prefix in a faster tier wins",
        ),
        (
            [_c(W0, requests=20, blocks={"hbm": 4}), _c(W1, requests=0)],
            W1,
            "the imbalance bound overrides the hot prefix",
        ),
        (
            [_c(W0, requests=6, blocks={"hbm": 4}), _c(W1, requests=0)],
            W0,
            "within the absolute slack the prefix still wins",
        ),
        (
            [_c(W0, requests=40, blocks={"hbm": 4}), _c(W1, requests=31), _c(W2, requests=30)],
            W0,
            "within the relative bound the prefix still wins",
        ),
    ],
)
def test_prefix_aware_choices(candidates: list[Candidate], expected: WorkerId, why: str) -> None:
    decision = make_policy("prefix_aware").choose(REQ, candidates)
    assert decision.worker == expected, why
    assert decision.policy == "prefix_aware"


def test_prefix_aware_reports_the_bound() -> None:
    decision = PrefixAware(abs_threshold=2).choose(
        REQ, [_c(W0, requests=9, blocks={"hbm": 4}), _c(W1, requests=1)]
    )
    assert decision.worker == W1 and "bound" in decision.reason


@pytest.mark.parametrize(
    ("blocks", "queued", "cost"),
    [
        (None, 0, 64.0),
        ({"hbm": 2}, 0, 32.0),
        ({"hbm": 4}, 0, 1.0),  # a full match still computes the last token
        ({"hbm": 2}, 100, 132.0),
        ({"hbm": 1, "dram": 1}, 0, 32.0 + 0.05 * 16),
        ({"redis": 2}, 0, 32.0 + 0.3 * 32),
    ],
)
def test_estimated_cost(blocks: dict[str, int] | None, queued: int, cost: float) -> None:
    assert estimated_cost(REQ, _c(W0, queued=queued, blocks=blocks)) == pytest.approx(cost)


def test_equal_candidates_take_turns() -> None:
    for name in policy_names():
        policy = make_policy(name)
        picks = [policy.choose(REQ, [_c(W0), _c(W1), _c(W2)]).worker for _ in range(6)]
        assert picks == [W0, W1, W2, W0, W1, W2], name


def test_round_robin_ignores_prefixes() -> None:
    policy = make_policy("round_robin")
    cands = [_c(W0, blocks={"hbm": 4}), _c(W1)]
    assert [policy.choose(REQ, cands).worker for _ in range(4)] == [W0, W1, W0, W1]


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ([_c(W0, queued=50), _c(W1, queued=10)], W1),
        ([_c(W0, requests=3, queued=10), _c(W1, requests=1, queued=10)], W1),
        ([_c(W0, queued=10, blocks={"hbm": 4}), _c(W1, queued=9)], W1),
    ],
)
def test_least_loaded(candidates: list[Candidate], expected: WorkerId) -> None:
    assert make_policy("least_loaded").choose(REQ, candidates).worker == expected


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="least_loaded.*prefix_aware.*round_robin"):
        make_policy("random")
