"""prefix_aware over a run of decisions: new prefixes spread by recent traffic, and a worker
that keeps winning its cached prefixes is bounded by its recent traffic."""

from __future__ import annotations

from cachesvc.index import PrefixMatch
from cachesvc.types import WorkerId
from router.policy import Candidate, PrefixAware, RouteRequest

W0, W1 = WorkerId("w0"), WorkerId("w1")
REQ = RouteRequest(num_prompt_tokens=64, block_size=16)


def _c(worker: WorkerId, queued: int = 0, blocks: int = 0) -> Candidate:
    match = PrefixMatch(worker, blocks, {"hbm": blocks}) if blocks else None
    return Candidate(worker, 0, queued, match)


def test_a_hot_prefix_is_bounded_by_recent_traffic() -> None:
    policy = PrefixAware()
    decisions = [policy.choose(REQ, [_c(W0, blocks=4), _c(W1)]) for _ in range(40)]
    picks = [d.worker for d in decisions]
    assert picks[:3] == [W0, W0, W0], "the cached prefix wins at first"
    assert 0.4 <= picks.count(W1) / len(picks) <= 0.5, picks
    assert all("bound" in d.reason for d in decisions if d.worker == W1)


def test_new_prefixes_go_where_recent_traffic_is_lowest() -> None:
    policy = PrefixAware()
    for _ in range(3):  # W0 served a group
        assert policy.choose(REQ, [_c(W0, blocks=4), _c(W1)]).worker == W0
    # A new prefix: W1 is slightly busier right now but has had less traffic.
    decision = policy.choose(REQ, [_c(W0), _c(W1, queued=20)])
    assert decision.worker == W1 and "least recent traffic" in decision.reason
    # ... but not when it would start much later than the fastest worker.
    decision = policy.choose(REQ, [_c(W0), _c(W1, queued=500)])
    assert decision.worker == W0
