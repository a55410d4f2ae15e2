"""The router's estimate with pulls from a holder, and pure affinity (`longest_prefix`)."""

from __future__ import annotations

import pytest

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.routing import Candidate, RouteRequest, estimated_cost, make_policy, pull_blocks
from workers.protocol import BlockCosts

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
REQ = RouteRequest(num_prompt_tokens=64, block_size=16)  # 4 blocks, the last one computed
PULLS = BlockCosts(compute_s=1e-3, fetch_s={"peer": 1e-4})  # a pulled block: a tenth of computing


def _c(
    worker: WorkerId,
    queued: int = 0,
    hbm: int = 0,
    costs: BlockCosts | None = None,
    peer: int = 0,
) -> Candidate:
    match = PrefixMatch(worker, hbm, {"hbm": hbm}) if hbm else None
    return Candidate(worker, 1 if queued else 0, queued, match, costs, peer)


@pytest.mark.parametrize(
    ("candidate", "cost", "pulled"),
    [
        (_c(W0, peer=3), 64.0, 0),  # reports no pull cost: it would compute
        (_c(W0, costs=PULLS, peer=3), 16.0 + 0.1 * 48, 3),
        (_c(W0, costs=PULLS, peer=4), 1.0 + 0.1 * 63, 4),  # the last token is still computed
        (_c(W0, hbm=2, costs=PULLS, peer=3), 32.0 + 0.1 * 16 - 16.0, 1),
        (_c(W0, hbm=3, costs=PULLS, peer=2), 16.0, 0),  # holds more than the holder
        (_c(W0, costs=BlockCosts(1.0, {"peer": 5.0}), peer=3), 64.0, 3),  # slow: as computing
    ],
)
def test_estimate_counts_the_pull(candidate: Candidate, cost: float, pulled: int) -> None:
    assert estimated_cost(REQ, candidate) == pytest.approx(cost)
    assert pull_blocks(REQ, candidate) == pulled


def test_a_busy_holder_sends_the_request_to_a_puller() -> None:
    # W0 holds the whole prefix but has a queue; W1 is idle and holds nothing.
    holder = _c(W0, queued=200, hbm=4, costs=PULLS, peer=0)
    policy = make_policy("prefix_aware")
    # Without pulls, recomputing 64 tokens on W1 costs more than a quarter of W0's queue.
    assert policy.choose(REQ, [holder, _c(W1, costs=PULLS, peer=0)]).worker == W0
    # With pulls, W1 gets the prefix for a tenth of the work and wins, and says so.
    decision = make_policy("prefix_aware").choose(REQ, [holder, _c(W1, costs=PULLS, peer=4)])
    assert decision.worker == W1 and decision.pull_blocks == 4
    assert "pulls 4 blocks" in decision.reason


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ([_c(W0, queued=10_000, hbm=3), _c(W1, hbm=2)], W0),  # affinity, whatever the queue
        ([_c(W0, queued=50, hbm=2), _c(W1, queued=10, hbm=2)], W1),  # ties: least queued
        ([_c(W0, queued=50), _c(W1, queued=10)], W1),
    ],
)
def test_longest_prefix(candidates: list[Candidate], expected: WorkerId) -> None:
    assert make_policy("longest_prefix").choose(REQ, candidates).worker == expected
