"""The learnt fixed cost of a hand-off (`router.policy.handoff_cost.HandoffCost`): one slow hand-off
(a pull that waited out a frozen holder) moves it a little and is soon forgotten, a pull that failed
is not learnt from, a real rise is learnt, and with no hand-off measured it returns to its prior,
so the P/D decision hands requests off again."""

from __future__ import annotations

import pytest

from cachesvc.kv.types import WorkerId
from router.metrics import RequestOutcome, RouterMetrics
from router.policy.handoff_cost import HANDOFF_FIXED_PRIOR_S, HandoffCost
from router.policy.pd import DecodeSide, PDDecision, PrefillSide, decide
from router.policy.routing import RouteDecision
from router.request.handoff import Handoff
from router.request.placement import Placed
from workers.protocol import StreamDelta, Usage

NORMAL_S = 0.02  # what a hand-off's fixed part takes here
K = 10  # hand-offs within which the estimate is back near normal


def _hands_off(fixed_s: float) -> bool:
    """A long prompt arriving at a decode worker with 8 running streams: handed off unless a
    hand-off's fixed part costs seconds."""
    here = DecodeSide(WorkerId("d"), 512, 0, 8, 1e-3, 1e-4)
    there = PrefillSide(WorkerId("p"), 512, 0, 1e-3)
    return decide(512, 16, here, there, handoff_fixed_s=fixed_s).disaggregate


def test_one_slow_handoff_is_forgotten_within_k_handoffs() -> None:
    cost = HandoffCost(HANDOFF_FIXED_PRIOR_S)
    assert _hands_off(cost.value(0.0))
    cost.observe(30.0, now_s=1.0)  # waited out the decode pull's timeout
    assert cost.value(1.0) < 5 * NORMAL_S
    for i in range(K):
        cost.observe(NORMAL_S, now_s=2.0 + i)
    assert cost.value(2.0 + K) == pytest.approx(NORMAL_S, rel=0.1)
    assert _hands_off(cost.value(2.0 + K))


def test_a_real_rise_is_learnt_and_without_handoffs_it_returns_to_the_prior() -> None:
    cost = HandoffCost(HANDOFF_FIXED_PRIOR_S)
    for i in range(30):
        cost.observe(6.0, now_s=float(i))
    assert cost.value(29.0) == pytest.approx(6.0, rel=0.1)
    assert not _hands_off(cost.value(29.0))  # nearly everything stays colocated now
    # Nothing handed off, nothing measured: the estimate still comes back.
    later = 29.0 + 20 * cost.half_life_s
    assert cost.value(later) == pytest.approx(HANDOFF_FIXED_PRIOR_S, rel=0.05)
    assert _hands_off(cost.value(later))


def _handoff(cost: HandoffCost) -> Handoff:
    decision = PDDecision(True, "test", handoff_s=0.05, handoff_fixed_s=0.02, pull_blocks=4)
    placed = Placed(RouteDecision(WorkerId("d"), "pd"))
    handoff = Handoff(decision, placed, cost=cost, full_tokens=64)
    handoff.handed_off, handoff.prefill_usage = True, Usage(70, 1, {}, 70, 1.0, None, "p")
    handoff.first_token_s = 0.0  # long ago on the perf counter: a very slow hand-off
    return handoff


@pytest.mark.parametrize(
    ("cached", "learnt"), [({"peer": 64}, True), ({"peer": 16}, False), ({}, False)]
)
def test_only_a_handoff_whose_pull_succeeded_is_learnt(
    cached: dict[str, int], learnt: bool
) -> None:
    """A pull that failed or timed out leaves the decode worker computing the prompt: its wait
    is the timeout's, not the hand-off's."""
    cost = HandoffCost(HANDOFF_FIXED_PRIOR_S)
    handoff = _handoff(cost)
    outcome = RequestOutcome("r", "pd")
    handoff.observe(StreamDelta(0, (5,), ""), RouterMetrics(), outcome)
    assert outcome.pd_handoff_ms is not None
    usage = Usage(71, 3, cached, 71 - sum(cached.values()), 1.0, None, "d")
    handoff.merged(StreamDelta(0, (6,), "", "length", usage))
    moved = cost.value(0.0) != HANDOFF_FIXED_PRIOR_S
    assert moved == learnt
