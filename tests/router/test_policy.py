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
from workers.protocol import BlockCosts

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
            [_c(W0, requests=40, blocks={"hbm": 4}), _c(W1, requests=0)],
            W1,
            "the request-count bound overrides the hot prefix",
        ),
        (
            [_c(W0, requests=3, queued=70_000, blocks={"hbm": 4}), _c(W1, requests=3)],
            W1,
            "the queued-work bound overrides the hot prefix",
        ),
        (
            [_c(W0, requests=3, queued=60_000, blocks={"hbm": 4}), _c(W1, requests=3, queued=40)],
            W1,
            "within the queue bound, a queue far longer than the prompt still loses",
        ),
        (
            [_c(W0, requests=3, queued=150, blocks={"hbm": 4}), _c(W1, requests=3)],
            W0,
            "a queue a few times the prompt's savings does not break affinity",
        ),
        (
            [_c(W0, requests=30, blocks={"hbm": 4}), _c(W1, requests=0)],
            W0,
            "within the absolute slack the prefix still wins",
        ),
        (
            [_c(W0, requests=90, blocks={"hbm": 4}), _c(W1, requests=50), _c(W2, requests=45)],
            W0,
            "within the relative bound the prefix still wins",
        ),
    ],
)
def test_prefix_aware_choices(candidates: list[Candidate], expected: WorkerId, why: str) -> None:
    decision = make_policy("prefix_aware").choose(REQ, candidates)
    assert decision.worker == expected, why
    assert decision.policy == "prefix_aware"


@pytest.mark.parametrize(
    ("candidates", "worker", "reason"),
    [
        ([_c(W0), _c(W1)], W0, "no cached prefix: lowest estimated ttft"),
        ([_c(W0), _c(W1, blocks={"hbm": 3})], W1, "cached prefix: lowest estimated ttft"),
        (
            [_c(W0, queued=90_000, blocks={"hbm": 3}), _c(W1, queued=100, blocks={"hbm": 1})],
            W1,
            "bounded: holder overloaded",
        ),
        (
            [_c(W0, queued=2_000, blocks={"hbm": 3}), _c(W1, queued=100, blocks={"hbm": 1})],
            W1,
            "shorter prefix than the busier holder: lowest estimated ttft",
        ),
        (
            [_c(W0, requests=9, blocks={"hbm": 4}), _c(W1, requests=1)],
            W1,
            "bounded: holder overloaded",
        ),
    ],
)
def test_prefix_aware_says_why(candidates: list[Candidate], worker: WorkerId, reason: str) -> None:
    decision = PrefixAware(abs_threshold=2).choose(REQ, candidates)
    assert (decision.worker, decision.reason) == (worker, reason)


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


@pytest.mark.parametrize(
    ("costs", "blocks", "cost"),
    [
        (None, {"nvme": 2}, 32.0 + 0.2 * 32),  # no report: the fixed weights
        (BlockCosts(1.0, {"nvme": 0.5}), {"nvme": 2}, 32.0 + 0.5 * 32),
        (BlockCosts(1.0, {"nvme": 3.0}), {"nvme": 2}, 64.0),  # slower than recompute: recompute
        (BlockCosts(1.0, {"nvme": 0.5}), {"dram": 2}, 32.0 + 0.05 * 32),  # unreported tier
        (BlockCosts(1.0, {"hbm": 0.5}), {"hbm": 2}, 32.0),  # the device is never a fetch
    ],
)
def test_fetch_costs_come_from_the_worker(
    costs: BlockCosts | None, blocks: dict[str, int], cost: float
) -> None:
    candidate = Candidate(W0, 0, 0, PrefixMatch(W0, sum(blocks.values()), blocks), costs)
    assert estimated_cost(REQ, candidate) == pytest.approx(cost)


def test_calibrated_costs_change_the_choice() -> None:
    # The same 3 blocks in NVMe on W0 and 2 in HBM on W1: by the fixed weights NVMe is cheap
    # and W0 wins; a worker whose NVMe reads cost as much as recomputing makes W1 the choice.
    slow = BlockCosts(compute_s=1e-3, fetch_s={"nvme": 1e-3})

    def cands(costs: BlockCosts | None) -> list[Candidate]:
        nvme = Candidate(W0, 0, 0, PrefixMatch(W0, 3, {"nvme": 3}), costs)
        return [nvme, _c(W1, blocks={"hbm": 2})]

    assert make_policy("prefix_aware").choose(REQ, cands(None)).worker == W0
    assert make_policy("prefix_aware").choose(REQ, cands(slow)).worker == W1


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
