"""Routing policies, picked by name from a registry: pure choices over candidate snapshots.

A policy sees, per live worker, its load, its cached prefix of the request and its calibrated
per-block costs (`Candidate`), and returns a `RouteDecision` that says why (`choose`, pure).
What it remembers (who was given a request when, the requests routed lately, how busy each
worker was) is noted apart, for the worker the request runs on once known (`record`; a request
handed off is noted where it decodes, one refused nowhere). Tested with tables of cases and
short runs of decisions (`choose_and_record`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cachesvc.kv.types import WorkerId
from router.policy.costs import (
    PEER,
    TIER_FETCH_COST,
    UNREPORTED_S_PER_TOKEN,
    Candidate,
    RouteRequest,
    can_pull,
    estimated_cost,
    fetch_weights,
    prefill_cost,
    pull_blocks,
    seconds_per_token,
)
from router.policy.recent import BusySeconds, Lately, RecentAmounts, mean_of

# What a policy sees and what a request costs live in `router.policy.costs`; named here too, where
# policies are looked for.
__all__ = [
    "PEER",
    "TIER_FETCH_COST",
    "UNREPORTED_S_PER_TOKEN",
    "Candidate",
    "Policy",
    "PrefixAware",
    "RouteDecision",
    "RouteRequest",
    "can_pull",
    "choose_and_record",
    "estimated_cost",
    "fetch_weights",
    "make_policy",
    "policy_names",
    "prefill_cost",
    "pull_blocks",
    "seconds_per_token",
]

# Requests a worker may always take above the mean, so that the first few decisions after a
# start (or an idle spell) bound nobody; once the mean is larger, `traffic_factor` times it is
# the bound, whatever the cluster's size (an absolute slack on top would loosen it by 2 / mean:
# 13% at 15 recent requests a worker).
_TRAFFIC_SLACK = 2.0


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why."""

    worker: WorkerId
    policy: str
    matched_blocks: int = 0
    estimated_cost_tokens: float | None = None
    reason: str = ""
    pull_blocks: int = 0  # blocks the worker is expected to pull from a holder


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        """Pick one of `candidates` (never empty); pure: the policy's memory is only read."""
        ...

    def record(
        self, request: RouteRequest, candidates: Sequence[Candidate], worker: WorkerId
    ) -> None:
        """Note that `request`, asked over `candidates` as `choose` saw them, runs on `worker`
        (one of them). Mutates; called once a request, for where it runs only."""
        ...


def choose_and_record(
    policy: Policy, request: RouteRequest, candidates: Sequence[Candidate]
) -> RouteDecision:
    """`policy`'s choice among `candidates`, recorded: the request runs where it chose."""
    decision = policy.choose(request, candidates)
    policy.record(request, candidates, decision.worker)
    return decision


@dataclass
class _Recency:
    """Ties go to the worker chosen longest ago, so equal workers share the load."""

    _clock: itertools.count[int] = field(default_factory=itertools.count)
    _last: dict[WorkerId, int] = field(default_factory=dict)

    def age_key(self, worker: WorkerId) -> int:
        return self._last.get(worker, -1)

    def chosen(self, worker: WorkerId) -> None:
        self._last[worker] = next(self._clock)

    def pick(
        self, candidates: Sequence[Candidate], key: Callable[[Candidate], tuple[int, ...]]
    ) -> Candidate:
        """The candidate with the least `key`, ties to the one chosen longest ago (pure)."""
        return min(candidates, key=lambda c: (*key(c), self.age_key(c.worker), c.worker))


class _Ties:
    """A policy whose only memory is its tie-breaks: who was given a request when."""

    def __init__(self) -> None:
        self._recency = _Recency()

    def record(
        self, request: RouteRequest, candidates: Sequence[Candidate], worker: WorkerId
    ) -> None:
        self._recency.chosen(worker)


class RoundRobin(_Ties):
    """Each worker in turn, whatever it holds."""

    name = "round_robin"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        pick = min(candidates, key=lambda c: (self._recency.age_key(c.worker), c.worker))
        return RouteDecision(pick.worker, self.name, _matched(pick), reason="next in turn")


class LeastLoaded(_Ties):
    """The worker with the fewest queued tokens, then the fewest requests."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        pick = self._recency.pick(candidates, lambda c: (c.num_queued_tokens, c.num_requests))
        return RouteDecision(pick.worker, self.name, _matched(pick), reason="least queued work")


class LongestPrefix(_Ties):
    """Pure cache affinity: the worker holding the longest prefix of the request (any tier),
    then the least queued work. No bound: a hot prefix stays on its holder however busy."""

    name = "longest_prefix"

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        pick = self._recency.pick(candidates, lambda c: (-_matched(c), c.num_queued_tokens))
        reason = "longest cached prefix" if _matched(pick) else "no cached prefix: least queued"
        return RouteDecision(pick.worker, self.name, _matched(pick), reason=reason)


class PrefixAware:
    """Cache affinity that survives moderate load, within a bound on queued work.

    Each worker gets a score in tokens of work: the part of the prompt it would compute, plus
    the cached part it would fetch from slower tiers weighted by the worker's own costs
    (`prefill_cost`), plus its queued work times `queue_weight`. The queue weighs less than the
    prompt (by default a quarter) because a queue is one instant's noisy view of the wait while
    a cached prefix is work saved for sure, and because sending a request away from its cache
    makes the cluster compute the prefix again: under load that extra work delays everyone.

    Real overload is the bound's job, not the score's: a worker whose queued work, in seconds
    at its own reported speed (`seconds_per_token`), exceeds `queue_factor` times the least-queued
    worker's plus `queue_slack_s` gets no request, however well its cache matches, and neither
    does one whose request count exceeds the least-loaded worker's by more than `abs_threshold`
    *and* by a factor above `rel_threshold` (a backstop for load signals that lag). A hot prefix
    then grows a second holder instead of a queue. A worker that was given more than
    `traffic_factor` times the mean number of recent requests over the candidates (or the mean
    plus two while it is small; decayed with a half-life of `work_half_life_s` seconds) is left
    out too, while others are not: a prefix hot enough to bring one worker that much more
    traffic than the rest is worth a copy elsewhere even before queues grow, and an ordinary
    group never gets there.

    What makes a worker the busiest over minutes is rarely its queue of one instant: it is the
    answers it decodes (whose lengths the router cannot know), the long prompts and the hot
    prefix it holds. So the policy measures each worker's busy seconds lately (time with work,
    seen at every decision, decayed with a half-life of `busy_half_life_s` seconds:
    `BusySeconds`), and a worker that was busier than the candidates' mean scores
    `busy_weight` times its excess worse, as tokens of the work the cluster did per busy
    second lately. A cached prefix holds a request against that only while recomputing it
    elsewhere would cost more: a short shared prompt (a system or tool prompt) spills to an
    idler worker soon, a long conversation stays unless its holder is far busier than the rest.
    The memory is longer than the traffic bound's (`work_half_life_s`): it evens out busy time
    over minutes, where the bound reacts to a burst.

    Among the workers within bound whose score is within `tie_fraction` of the prompt's length
    of the best, the request goes to the one with the fewest busy seconds lately plus queued
    seconds to come. So a request that nobody holds much of (a new conversation, or one whose
    only match is a system prompt every worker holds) starts its group where there has been
    least to do; a request that a worker holds a real part of stays there.

    Every figure is per worker or in seconds, so one setting means the same on 2 workers and on
    128, on a CPU and on an H100.
    """

    name = "prefix_aware"

    def __init__(
        self,
        abs_threshold: int = 32,
        rel_threshold: float = 2.0,
        queue_factor: float = 2.0,
        queue_slack_s: float = 2.0,
        queue_weight: float = 0.25,
        tie_fraction: float = 0.1,
        work_half_life_s: float = 30.0,
        traffic_factor: float = 1.5,
        busy_weight: float = 1.0,
        busy_half_life_s: float = 120.0,
    ) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.queue_factor = queue_factor
        self.queue_slack_s = queue_slack_s
        self.queue_weight = queue_weight
        self.tie_fraction = tie_fraction
        self.work_half_life_s = work_half_life_s
        self.traffic_factor = traffic_factor
        self.busy_weight = busy_weight
        self.busy_half_life_s = busy_half_life_s
        self._recency = _Recency()
        self._traffic = RecentAmounts(work_half_life_s)  # requests routed lately
        # Seconds each worker had work lately, and the prefill tokens routed to it meanwhile.
        self._busy = BusySeconds(busy_half_life_s)
        self._work = RecentAmounts(busy_half_life_s)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        lately = self._lately(request, candidates)
        rates = seconds_per_token(request, candidates)
        queued = {c.worker: c.num_queued_tokens * rates[c.worker] for c in candidates}
        loaded = self._within_load_bound(candidates, queued)
        eligible = self._within_traffic_bound(loaded, candidates, lately)
        scores = self._scores(request, candidates, eligible, lately)
        best = min(scores.values())
        limit = best + self.tie_fraction * request.num_prompt_tokens
        near = [c for c in eligible if scores[c.worker] <= limit or c.worker == request.affinity]
        pick = min(
            near,
            key=lambda c: (
                c.worker != request.affinity,  # an affinity key's worker within bounds wins
                lately.busy[c.worker] + queued[c.worker],
                scores[c.worker],
                self._recency.age_key(c.worker),
                c.worker,
            ),
        )
        reason = _reason(pick, candidates, loaded, eligible, lowest=scores[pick.worker] == best)
        pulled = pull_blocks(request, pick)
        if pulled:
            reason += f"; pulls {pulled} blocks from the holder"
        cost = estimated_cost(request, pick)
        return RouteDecision(pick.worker, self.name, _matched(pick), cost, reason, pulled)

    def record(
        self, request: RouteRequest, candidates: Sequence[Candidate], worker: WorkerId
    ) -> None:
        """The loads seen, and `worker` given the request: one more request routed there, busy
        from now, and the request's prefill at its cost as its candidate says."""
        for recent in (self._traffic, self._work):
            recent.advance(request.now_s, (c.worker for c in candidates))
        self._busy.observe(request.now_s, _loads(candidates))
        runs = next(c for c in candidates if c.worker == worker)
        self._recency.chosen(worker)
        self._busy.given(worker, request.now_s)
        self._traffic.add(worker, 1.0)
        self._work.add(worker, prefill_cost(request, runs))

    def _lately(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Lately:
        """The memory as `record` would read it before noting the request (pure)."""
        workers = [c.worker for c in candidates]
        return Lately(
            self._traffic.at(request.now_s, workers),
            self._busy.at(request.now_s, _loads(candidates)),
            self._work.at(request.now_s, workers),
        )

    def _scores(
        self,
        request: RouteRequest,
        candidates: Sequence[Candidate],
        eligible: Sequence[Candidate],
        lately: Lately,
    ) -> dict[WorkerId, float]:
        """Each eligible worker's score in tokens of work: its prefill of the request, a share
        of its queue, and its busy seconds above the candidates' mean as tokens, at the rate
        the candidates were given prefill tokens per busy second lately.

        That rate is measured, not reported: it holds on a CPU as on an H100, with or without
        reported costs, and it counts the decoding that a prompt brings along. A worker idle
        right now pays for its past too: busy time is evened out over minutes, and sparing
        idle holders left the busiest hosts of a hot prompt 11% above the mean on 128 workers
        (`cachesvc simulate --workload generated`) against 6% without."""
        mean_busy = mean_of(lately.busy)
        busy_s = mean_busy * len(candidates)
        work = sum(lately.work.values())
        tokens_per_s = work / busy_s if busy_s > 0 else 0.0
        scores = {}
        for c in eligible:
            excess_s = max(0.0, lately.busy[c.worker] - mean_busy)
            scores[c.worker] = (
                prefill_cost(request, c)
                + self.queue_weight * c.num_queued_tokens
                + self.busy_weight * excess_s * tokens_per_s
            )
        return scores

    def _within_traffic_bound(
        self, loaded: list[Candidate], candidates: Sequence[Candidate], lately: Lately
    ) -> list[Candidate]:
        """Leave out of `loaded` the workers that got far more than the mean of recent
        requests over all `candidates` (workers that left routing weigh nothing), unless that
        would leave nobody."""
        if self.traffic_factor <= 0:
            return loaded
        mean = mean_of(lately.traffic)
        ceiling = max(self.traffic_factor * mean, mean + _TRAFFIC_SLACK)
        light = [c for c in loaded if lately.traffic[c.worker] <= ceiling]
        return light or loaded

    def _within_load_bound(
        self, candidates: Sequence[Candidate], queued: Mapping[WorkerId, float]
    ) -> list[Candidate]:
        """The `candidates` within both load bounds (`queued`: seconds of queued work each)."""
        least_requests = min(c.num_requests for c in candidates)
        ceiling = self.queue_factor * min(queued.values()) + self.queue_slack_s
        within = [
            c
            for c in candidates
            if queued[c.worker] <= ceiling
            and (
                c.num_requests - least_requests <= self.abs_threshold
                or c.num_requests <= least_requests * self.rel_threshold
            )
        ]
        # The two bounds together exclude everyone only when the load signals disagree (the
        # fewest requests on one worker, the least queued work on another): the latter wins.
        return within or [min(candidates, key=lambda c: (queued[c.worker], c.worker))]


def _reason(
    pick: Candidate,
    candidates: Sequence[Candidate],
    loaded: Sequence[Candidate],
    eligible: Sequence[Candidate],
    lowest: bool,
) -> str:
    """Why `pick`: what it holds compared with the longest cached prefix anywhere, which bound
    left the holders out if one did, and how it won (the lowest score, or the least busy
    among near ties)."""
    how = "lowest estimated ttft" if lowest else "least busy lately among near ties"
    longest = max(_matched(c) for c in candidates)
    if longest == 0:
        return f"no cached prefix: {how}"
    if _matched(pick) == longest:
        return f"cached prefix: {how}"
    if all(_matched(c) < longest for c in loaded):
        return "bounded: holder overloaded"
    if all(_matched(c) < longest for c in eligible):
        return "bounded: holder took more than its share of recent requests"
    return f"shorter prefix than the busier holder: {how}"


def _loads(candidates: Sequence[Candidate]) -> list[tuple[WorkerId, bool]]:
    return [(c.worker, c.num_requests > 0) for c in candidates]


def _matched(candidate: Candidate) -> int:
    return 0 if candidate.match is None else candidate.match.num_blocks


_REGISTRY: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: lambda **_: RoundRobin(),
    LeastLoaded.name: lambda **_: LeastLoaded(),
    LongestPrefix.name: lambda **_: LongestPrefix(),
    PrefixAware.name: lambda **kw: PrefixAware(**kw),
}


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **options: Any) -> Policy:
    """A fresh policy by registry name, with its options (`PrefixAware`'s thresholds; the
    others take none and ignore them); raises ValueError listing the known names."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {policy_names()}")
    return factory(**options)
