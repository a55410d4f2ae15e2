"""Routing policies as tables of cases: who gets the request, and why."""

from __future__ import annotations

import pytest

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.routing import (
    Candidate,
    PrefixAware,
    RouteRequest,
    choose_and_record,
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
        picks = [choose_and_record(policy, REQ, [_c(W0), _c(W1), _c(W2)]).worker for _ in range(6)]
        assert picks == [W0, W1, W2, W0, W1, W2], name


def test_round_robin_ignores_prefixes() -> None:
    policy = make_policy("round_robin")
    cands = [_c(W0, blocks={"hbm": 4}), _c(W1)]
    assert [choose_and_record(policy, REQ, cands).worker for _ in range(4)] == [W0, W1, W0, W1]


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


# ---- the same figure on any cluster: per-worker means, time decay, seconds of work ----------

HOT = RouteRequest(num_prompt_tokens=64, block_size=16)  # W0 holds 3 of its 4 blocks
SHARE = "bounded: holder took more than its share of recent requests"


def _workers(n: int) -> list[WorkerId]:
    return [WorkerId(f"w{i}") for i in range(n)]


def _give(policy: PrefixAware, counts: dict[WorkerId, int], rounds: int) -> None:
    """Route `counts[w]` requests to each worker per second for `rounds` seconds (each time the
    worker's only candidate), so its recent traffic is what the test says."""
    for second in range(rounds):
        for worker, count in counts.items():
            for _ in range(count):
                choose_and_record(policy, RouteRequest(64, 16, float(second)), [_c(worker)])


def _hot_choice(policy: PrefixAware, workers: list[WorkerId], now_s: float) -> str:
    """The reason of a request whose prefix only W0 holds, all workers idle."""
    candidates = [_c(w, blocks={"hbm": 3} if w == W0 else None) for w in workers]
    return choose_and_record(policy, RouteRequest(64, 16, now_s), candidates).reason


@pytest.mark.parametrize(
    ("num_workers", "holder_rate", "others_rate", "bounded"),
    [
        # The holder was given twice the mean of recent requests: bounded on any cluster.
        (2, 2, 0, True),
        (128, 2, 1, True),
        # A fifth above the mean is an ordinary group: left alone on any cluster.
        (2, 6, 4, False),
        (128, 6, 5, False),
    ],
)
def test_the_traffic_bound_means_the_same_at_any_size(
    num_workers: int, holder_rate: int, others_rate: int, bounded: bool
) -> None:
    policy = PrefixAware()
    workers = _workers(num_workers)
    _give(policy, {w: holder_rate if w == W0 else others_rate for w in workers}, rounds=20)
    reason = _hot_choice(policy, workers, now_s=19.0)
    assert (reason == SHARE) is bounded, reason


def test_a_departed_worker_weighs_nothing_in_the_mean() -> None:
    # W3 took a flood of requests, then left routing; W0 took thrice what W1 and W2 did.
    policy = PrefixAware()
    _give(policy, {W0: 3, W1: 1, W2: 1, WorkerId("w3"): 20}, rounds=20)
    assert _hot_choice(policy, [W0, W1, W2], now_s=19.0) == SHARE
    _give(policy, {W1: 1}, rounds=1)  # time passes (a half-life and more)
    choose_and_record(policy, RouteRequest(64, 16, 20.0 + policy.work_half_life_s), [_c(W1)])
    assert "w3" not in policy._traffic.known(), "forgotten after a half-life away"


@pytest.mark.parametrize(
    ("quiet_s", "decisions_between", "bounded"),
    [
        (0.5, 0, True),  # right after its burst the holder is bounded
        (0.5, 80, True),  # many decisions (shared evenly) in half a second forget nothing
        (300.0, 0, False),  # ten half-lives later its burst is forgotten, decisions or not
    ],
)
def test_recent_traffic_decays_by_time(
    quiet_s: float, decisions_between: int, bounded: bool
) -> None:
    policy = PrefixAware(work_half_life_s=30.0)
    workers = _workers(8)
    _give(policy, {w: 1 for w in workers}, rounds=10)
    for _ in range(40):  # a burst for W0's prefix at t = 9
        choose_and_record(policy, RouteRequest(64, 16, 9.0), [_c(W0)])
    for i in range(decisions_between):  # traffic in between, spread evenly
        choose_and_record(policy, RouteRequest(64, 16, 9.0 + quiet_s / 2), [_c(workers[i % 8])])
    reason = _hot_choice(policy, workers, now_s=9.0 + quiet_s)
    assert (reason == SHARE) is bounded, reason


CPU = BlockCosts(compute_s=16 * 2.4e-3)  # seconds per 16-token block: a small model on a CPU
H100 = BlockCosts(compute_s=16 * 32.5e-6)


@pytest.mark.parametrize(
    ("holder_costs", "other_costs", "queued", "bounded"),
    [
        # 2000 queued tokens: under a second's work on an H100, ~5 s on a CPU (slack 2 s).
        (H100, H100, 2000, False),
        (CPU, CPU, 2000, True),
        (None, CPU, 2000, True),  # a worker that reports nothing is taken to be like the rest
        (None, None, 2000, False),  # nobody reports: an H100's speed is assumed
        (CPU, CPU, 500, False),  # 1.2 s on a CPU: within the slack
        (H100, H100, 60_000, False),
        (H100, H100, 70_000, True),  # the old 65 536-token slack, for an H100
    ],
)
def test_queue_slack_is_seconds_of_the_workers_own_work(
    holder_costs: BlockCosts | None, other_costs: BlockCosts | None, queued: int, bounded: bool
) -> None:
    policy = PrefixAware(queue_weight=0.0)  # the bound alone decides against the prefix
    holder = Candidate(W0, 1, queued, PrefixMatch(W0, 3, {"hbm": 3}), holder_costs)
    decision = choose_and_record(policy, REQ, [holder, Candidate(W1, 0, 0, None, other_costs)])
    assert (decision.reason == "bounded: holder overloaded") is bounded, decision.reason
    assert (decision.worker == W1) is bounded
