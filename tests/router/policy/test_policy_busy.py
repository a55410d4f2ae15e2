"""prefix_aware balances the seconds each worker is busy: measured at every decision from the
workers' own loads (`BusySeconds`), forgotten by time, and weighed against the prefill a cached
prefix saves, as the tokens of work the cluster was given per busy second."""

from __future__ import annotations

import pytest

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.recent import BusySeconds
from router.policy.routing import Candidate, PrefixAware, RouteRequest, choose_and_record

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
BLOCK = 512  # the Mooncake traces' blocks


def test_busy_seconds_count_the_intervals_a_worker_had_work() -> None:
    busy = BusySeconds(half_life_s=30.0)
    busy.observe(0.0, [(W0, True), (W1, False)])
    busy.observe(2.0, [(W0, False), (W1, False)])
    assert (busy.get(W0), busy.get(W1)) == (2.0, 0.0)
    busy.observe(32.0, [(W0, False), (W1, True)])  # idle for a half-life: W0's seconds halve
    assert busy.get(W0) == pytest.approx(1.0)
    busy.given(W0, 32.0)  # a request just went to W0: busy until seen again
    busy.observe(33.0, [(W0, False), (W1, False)])
    assert busy.get(W0) == pytest.approx(1.0 * 0.5 ** (1 / 30) + 1.0)
    assert busy.get(W1) == pytest.approx(1.0)
    assert busy.mean([W0, W1, W2]) == pytest.approx((busy.get(W0) + 1.0) / 3)


def test_a_worker_away_for_a_half_life_is_not_credited_the_gap() -> None:
    busy = BusySeconds(half_life_s=10.0)
    busy.observe(0.0, [(W0, True), (W1, False)])
    busy.observe(25.0, [(W1, False)])  # W0 left routing busy: forgotten
    busy.observe(26.0, [(W0, True), (W1, False)])  # back (a replacement): no 26 s of work
    assert busy.get(W0) == 0.0


def _keep_busy(policy: PrefixAware, seconds: int, blocks_each: int = 10) -> None:
    """One new group a second (`blocks_each` blocks, nothing cached) while W0 always has
    requests and W1 and W2 finish theirs within the second: W0 ends up the busiest, about 9 s
    above the mean after 30 s, and the cluster is given blocks_each * 256 tokens per busy
    second (one new group's prompt, for two workers' busy seconds)."""
    for second in range(seconds):
        candidates = [Candidate(W0, 2, 0), Candidate(W1, 0, 0), Candidate(W2, 0, 0)]
        choose_and_record(
            policy, RouteRequest(blocks_each * BLOCK, BLOCK, float(second)), candidates
        )


def _held_by_w0(cached_blocks: int) -> list[Candidate]:
    match = PrefixMatch(W0, cached_blocks, {"hbm": cached_blocks})
    return [Candidate(W0, 1, 0, match), Candidate(W1, 0, 0), Candidate(W2, 0, 0)]


@pytest.mark.parametrize(
    ("cached_blocks", "stays"),
    [
        (4, False),  # a system prompt (2 048 tokens) against ~24 700 tokens of excess: moved
        (120, True),  # a long conversation (61 440 tokens): worth waiting for
    ],
)
def test_a_busy_holder_keeps_what_would_cost_more_to_recompute(
    cached_blocks: int, stays: bool
) -> None:
    policy = PrefixAware()
    _keep_busy(policy, 30)
    request = RouteRequest((cached_blocks + 10) * BLOCK, BLOCK, 30.0)
    decision = choose_and_record(policy, request, _held_by_w0(cached_blocks))
    assert (decision.worker == W0) is stays, decision.reason
    if not stays:
        assert decision.reason == "shorter prefix than the busier holder: lowest estimated ttft"
    # Without the weight on busy seconds the system prompt keeps the request too.
    unweighted = PrefixAware(busy_weight=0.0)
    _keep_busy(unweighted, 30)
    assert choose_and_record(unweighted, request, _held_by_w0(cached_blocks)).worker == W0


def test_busy_seconds_weigh_as_the_work_the_cluster_did_in_them() -> None:
    # The same 9 s of excess: ~24 700 tokens where the cluster was given 2 560 tokens per busy
    # second (an H100's pace, say), ~2 500 where it was given 256 (a CPU's): there a 4 096-token
    # tool prompt keeps its holder. No worker reports its speed either way.
    for blocks_each, stays in ((10, False), (1, True)):
        policy = PrefixAware()
        _keep_busy(policy, 30, blocks_each)
        decision = choose_and_record(policy, RouteRequest(18 * BLOCK, BLOCK, 30.0), _held_by_w0(8))
        assert (decision.worker == W0) is stays, (blocks_each, decision.reason)
