"""The one function the router and the simulator route through: candidates from live workers and
index matches, the policy's choice, and a holder named only to a worker that pulls."""

from __future__ import annotations

import pytest

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.placement import LiveWorker, choose
from router.policy.routing import RouteRequest, make_policy
from workers.protocol import BlockCosts

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
REQ = RouteRequest(num_prompt_tokens=64, block_size=16)
PULLS = BlockCosts(compute_s=1e-3, fetch_s={"peer": 1e-4})  # pulls are on: a pull cost
TIERS = BlockCosts(compute_s=1e-3, fetch_s={"dram": 1e-4})  # lower tiers, pulls off


def _match(worker: WorkerId, blocks: int) -> PrefixMatch:
    return PrefixMatch(worker, blocks, {"hbm": blocks})


@pytest.mark.parametrize(
    ("chooser_costs", "holder", "holder_blocks", "pull_blocks"),
    [
        (PULLS, W0, 3, 3),  # it pulls: named the holder, and the policy counts the pull
        (TIERS, None, 0, 0),  # lower tiers but no pull cost: it cannot pull, no hint
        (None, None, 0, 0),  # reports nothing: no hint
    ],
)
def test_a_holder_is_named_only_to_a_worker_that_pulls(
    chooser_costs: BlockCosts | None, holder: WorkerId | None, holder_blocks: int, pull_blocks: int
) -> None:
    # W0 holds the prefix but its queue is past the bound: the request goes to W1.
    live = [LiveWorker(W0, 3, 10**7, PULLS), LiveWorker(W1, 0, 0, chooser_costs)]
    choice = choose(make_policy("prefix_aware"), REQ, live, {W0: _match(W0, 3)}, {W0, W1})
    assert choice.decision.worker == W1
    assert (choice.holder, choice.holder_blocks) == (holder, holder_blocks)
    assert choice.decision.pull_blocks == pull_blocks
    assert ("pulls" in choice.decision.reason) is bool(pull_blocks)


@pytest.mark.parametrize(
    ("matches", "holders", "expected"),
    [
        ({W0: 3, W1: 1}, {W0, W1, W2}, (W0, 3)),  # the longest other holder
        ({W0: 3, W2: 2}, {W1, W2}, (W2, 2)),  # W0 cannot be pulled from (unhealthy, say)
        ({W0: 3}, set(), (None, 0)),  # pulls off at the router: no holders
        ({W1: 2, W0: 1}, {W0, W1}, (None, 0)),  # the chosen one holds more than the others
    ],
)
def test_the_holder_is_the_longest_other_pullable_match(
    matches: dict[WorkerId, int], holders: set[WorkerId], expected: tuple[WorkerId | None, int]
) -> None:
    live = [LiveWorker(W0, 3, 10**7, PULLS), LiveWorker(W1, 0, 0, PULLS)]
    index = {w: _match(w, n) for w, n in matches.items()}
    choice = choose(make_policy("prefix_aware"), REQ, live, index, holders)
    assert choice.decision.worker == W1
    assert (choice.holder, choice.holder_blocks) == expected


def test_candidates_see_their_own_match_and_the_others_longest() -> None:
    seen = []

    class Spy:
        name = "spy"

        def choose(self, request, candidates):  # type: ignore[no-untyped-def]
            seen.extend(candidates)
            return make_policy("least_loaded").choose(request, candidates)

        def record(self, request, candidates, worker):  # type: ignore[no-untyped-def]
            raise AssertionError("choosing records nothing")

    live = [LiveWorker(w, 0, 0, PULLS) for w in (W0, W1, W2)]
    choose(Spy(), REQ, live, {W0: _match(W0, 3), W1: _match(W1, 1)}, {W0, W1, W2})
    by_worker = {c.worker: c for c in seen}
    assert [by_worker[w].peer_blocks for w in (W0, W1, W2)] == [1, 3, 3]
    assert by_worker[W2].match is None and by_worker[W0].match == _match(W0, 3)


def test_a_choice_is_recorded_only_where_the_request_runs() -> None:
    """`choose` records nothing: asked again, round robin answers the same; told the request
    runs on a worker it did not see, it still does; told it runs on W0, it turns to W1."""
    policy = make_policy("round_robin")
    live = [LiveWorker(w, 0, 0) for w in (W0, W1)]
    first = choose(policy, REQ, live, {})
    assert first.decision.worker == W0
    assert choose(policy, REQ, live, {}).decision.worker == W0
    first.asked.record(W2)
    assert choose(policy, REQ, live, {}).decision.worker == W0
    first.asked.record(W0)
    assert choose(policy, REQ, live, {}).decision.worker == W1
