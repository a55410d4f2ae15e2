"""prefix_aware over runs of decisions: affinity survives a growing queue until the bound,
groups spread by how busy the workers were lately, a prefix everyone holds pins nothing, and
one that takes most requests grows a copy."""

from __future__ import annotations

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.routing import (
    UNREPORTED_S_PER_TOKEN,
    Candidate,
    PrefixAware,
    RouteRequest,
    choose_and_record,
)

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
BLOCK = 16


def _c(worker: WorkerId, queued: int = 0, blocks: int = 0) -> Candidate:
    match = PrefixMatch(worker, blocks, {"hbm": blocks}) if blocks else None
    return Candidate(worker, 0, queued, match)


def test_a_hot_prefix_stays_until_its_holder_is_overloaded() -> None:
    # No worker reports its speed: the slack of 4096 tokens at the assumed one. The traffic
    # bound is off: every request going to one of two workers would trip it on its own.
    policy = PrefixAware(queue_slack_s=4096 * UNREPORTED_S_PER_TOKEN, traffic_factor=0.0)
    request = RouteRequest(num_prompt_tokens=64 * BLOCK, block_size=BLOCK)  # 63 blocks cached
    picks = []
    for queued in range(0, 8000, 500):  # the holder's queue grows; the other worker is idle
        decision = choose_and_record(policy, request, [_c(W0, queued=queued, blocks=63), _c(W1)])
        picks.append((queued, decision.worker, decision.reason))
    assert all(w == W0 for q, w, _ in picks if q <= 3500), "a queue 4x the savings is still ok"
    assert all(w == W1 for q, w, _ in picks if q > 4096), "beyond the slack it is bounded"
    assert {r for q, _, r in picks if q > 4096} == {"bounded: holder overloaded"}


def test_new_groups_go_where_workers_were_least_busy() -> None:
    # W0 keeps its requests (long answers, say), W1 and W2 finish theirs within a second; new
    # groups arrive every second. Counted in prefill tokens given, W0 would get every third.
    policy = PrefixAware()
    picks = []
    for second in range(12):
        candidates = [Candidate(W0, 3, 0), _c(W1), _c(W2)]
        picks.append(
            choose_and_record(policy, RouteRequest(256, BLOCK, float(second)), candidates).worker
        )
    assert picks[0] == W0, "all idle at first"
    assert W0 not in picks[1:], "busy ever since: no new group"
    assert picks[1:] == [W1, W2] * 5 + [W1], "the idle ones take turns"
    # ... unless that worker would start it much later than the fastest.
    late = RouteRequest(256, BLOCK, 12.0)
    decision = choose_and_record(
        policy, late, [_c(W0, queued=50_000), _c(W1, queued=50_000), _c(W2)]
    )
    assert decision.worker == W2


def test_a_prefix_every_worker_holds_pins_nothing() -> None:
    # A one-block system prompt of a 40-block conversation: held by W0 only at first.
    policy = PrefixAware()
    request = RouteRequest(40 * BLOCK, BLOCK)
    picks = [
        choose_and_record(policy, request, [_c(W0, blocks=1), _c(W1), _c(W2)]).worker
        for _ in range(6)
    ]
    assert set(picks) == {W0, W1, W2}, "a sliver of the prompt is a near tie, not a reason"
    picks = [
        choose_and_record(
            policy, request, [_c(W0, blocks=1), _c(W1, blocks=1), _c(W2, blocks=1)]
        ).worker
        for _ in range(6)
    ]
    assert sorted(picks) == [W0, W0, W1, W1, W2, W2]


def test_a_real_share_of_the_prompt_keeps_its_holder() -> None:
    policy = PrefixAware()
    request = RouteRequest(40 * BLOCK, BLOCK)
    for _ in range(10):  # three groups, each on its own worker, come back in turn
        for holder in (W0, W1, W2):
            cands = [_c(w, blocks=20 if w == holder else 0) for w in (W0, W1, W2)]
            decision = choose_and_record(policy, request, cands)
            assert decision.worker == holder
            assert decision.reason == "cached prefix: lowest estimated ttft"


def test_a_prefix_taking_most_requests_grows_copies() -> None:
    policy = PrefixAware()
    request = RouteRequest(40 * BLOCK, BLOCK)
    holders = {W0}
    reasons = []
    for _ in range(30):  # every request wants the same prefix; a worker chosen holds it after
        cands = [_c(w, blocks=20 if w in holders else 0) for w in (W0, W1, W2)]
        decision = choose_and_record(policy, request, cands)
        holders.add(decision.worker)
        reasons.append(decision.reason)
    assert len(holders) >= 2, "a second worker computes the prefix once"
    assert "bounded: holder took more than its share of recent requests" in reasons
    assert set(reasons[-10:]) == {"cached prefix: lowest estimated ttft"}, "then they share it"
