"""Routing policies, picked by name from a registry: pure choices over candidate snapshots.

A policy sees, per live worker, its load, its cached prefix of the request and its calibrated
per-block costs (`Candidate`), and returns a `RouteDecision` that says why. Policies keep only a
little state of their own (who was chosen when, the work routed lately), so they are tested with
tables of cases and short runs of decisions.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cachesvc.index import PrefixMatch
from cachesvc.types import WorkerId
from router.recent import RecentAmounts
from workers.protocol import BlockCosts

# Cost of bringing one cached token into the device pool, relative to recomputing it (1.0), for
# a worker that does not report its own (`BlockCosts`: only workers with lower tiers do).
TIER_FETCH_COST: Mapping[str, float] = {"hbm": 0.0, "dram": 0.05, "nvme": 0.2, "redis": 0.3}
_UNKNOWN_TIER_COST = 0.5
PEER = "peer"  # the pseudo-tier of a pull from another worker, in `BlockCosts.fetch_s`
# Requests a worker may always take above the mean, so that the first few decisions after a
# start (or an idle spell) bound nobody; once the mean is larger, `traffic_factor` times it is
# the bound, whatever the cluster's size (an absolute slack on top would loosen it by 2 / mean:
# 13% at 15 recent requests a worker).
_TRAFFIC_SLACK = 2.0
# Seconds of prefill per token of a worker that reports no costs while no other candidate does
# either (workers without lower tiers or pulls report none): an H100's for an 8B model
# (`h100-llama3-8b`), so such a cluster keeps the slack it always had (2 s: 65 536 tokens).
UNREPORTED_S_PER_TOKEN = 32.5e-6


@dataclass(frozen=True)
class Candidate:
    """One live worker as a policy sees it."""

    worker: WorkerId
    num_requests: int  # running + waiting
    num_queued_tokens: int  # tokens still to compute ahead of a new request
    match: PrefixMatch | None = None  # its cached prefix of this request; None: nothing
    costs: BlockCosts | None = None  # its calibrated per-block costs, when it reports them
    # The longest prefix of this request another worker holds, that this one may pull (it
    # counts only when the worker reports a pull cost: `BlockCosts.fetch_s["peer"]`).
    peer_blocks: int = 0


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of the request itself."""

    num_prompt_tokens: int
    block_size: int
    # When it is routed, in seconds on a clock that never goes back (the router's monotonic
    # clock, the simulator's): the policies' memory of recent work decays by it.
    now_s: float = 0.0


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
        """Pick one of `candidates` (never empty); may update tie-breaking state."""
        ...


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
        """The candidate with the least `key`, ties to the one chosen longest ago; noted."""
        best = min(candidates, key=lambda c: (*key(c), self.age_key(c.worker), c.worker))
        self.chosen(best.worker)
        return best


class RoundRobin:
    """Each worker in turn, whatever it holds."""

    name = "round_robin"

    def __init__(self) -> None:
        self._recency = _Recency()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        pick = min(candidates, key=lambda c: (self._recency.age_key(c.worker), c.worker))
        self._recency.chosen(pick.worker)
        return RouteDecision(pick.worker, self.name, _matched(pick), reason="next in turn")


class LeastLoaded:
    """The worker with the fewest queued tokens, then the fewest requests."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._recency = _Recency()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        pick = self._recency.pick(candidates, lambda c: (c.num_queued_tokens, c.num_requests))
        return RouteDecision(pick.worker, self.name, _matched(pick), reason="least queued work")


class LongestPrefix:
    """Pure cache affinity: the worker holding the longest prefix of the request (any tier),
    then the least queued work. No bound: a hot prefix stays on its holder however busy."""

    name = "longest_prefix"

    def __init__(self) -> None:
        self._recency = _Recency()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        pick = self._recency.pick(candidates, lambda c: (-_matched(c), c.num_queued_tokens))
        reason = "longest cached prefix" if _matched(pick) else "no cached prefix: least queued"
        return RouteDecision(pick.worker, self.name, _matched(pick), reason=reason)


def fetch_weights(candidate: Candidate) -> Mapping[str, float]:
    """Cost of bringing one cached token into the device, relative to recomputing it, per
    tier: the worker's own calibrated costs when it reports them, else `TIER_FETCH_COST`.
    Never above 1: the worker's planner recomputes rather than fetch slower than that."""
    costs = candidate.costs
    if costs is None or costs.compute_s <= 0:
        return TIER_FETCH_COST
    weights = {tier: min(1.0, max(0.0, s / costs.compute_s)) for tier, s in costs.fetch_s.items()}
    return {**TIER_FETCH_COST, **weights, "hbm": 0.0}


def estimated_cost(request: RouteRequest, candidate: Candidate) -> float:
    """Tokens of work before the request's first token on `candidate`: its queue, the
    uncached part of the prompt to recompute, and the cached part to fetch from slower tiers."""
    return candidate.num_queued_tokens + prefill_cost(request, candidate)


def prefill_cost(request: RouteRequest, candidate: Candidate) -> float:
    """Tokens of work of the request itself on `candidate`: the uncached part of the prompt,
    the cached part in slower tiers weighted by its fetch cost (`fetch_weights`), and the part
    it can pull from a holder weighted by its pull cost."""
    match = candidate.match
    cached_blocks = 0 if match is None else match.num_blocks
    # The engine always computes the last prompt token itself, so a full match still costs one.
    most = max(request.num_prompt_tokens - 1, 0)
    matched = min(cached_blocks * request.block_size, most)
    weights = fetch_weights(candidate)
    fetch = 0.0
    if match is not None:
        for tier, num_blocks in match.blocks_by_tier.items():
            fetch += weights.get(tier, _UNKNOWN_TIER_COST) * num_blocks * request.block_size
    pulled = pull_blocks(request, candidate) * request.block_size
    pulled = min(pulled, most - matched)
    return (request.num_prompt_tokens - matched - pulled) + fetch + weights.get(PEER, 1.0) * pulled


def can_pull(costs: BlockCosts | None) -> bool:
    """Whether a worker with these reported costs pulls blocks from others: it reports a pull
    cost only when its pulls are on (`BlockCosts.fetch_s["peer"]`)."""
    return costs is not None and PEER in costs.fetch_s


def pull_blocks(request: RouteRequest, candidate: Candidate) -> int:
    """Blocks `candidate` would pull from the worker holding the longest prefix: what that one
    holds beyond its own, when it pulls at all (`can_pull`)."""
    if not can_pull(candidate.costs):
        return 0
    own = 0 if candidate.match is None else candidate.match.num_blocks
    return max(0, candidate.peer_blocks - own)


class PrefixAware:
    """Cache affinity that survives moderate load, within a bound on queued work.

    Each worker gets a score in tokens of work: the part of the prompt it would compute, plus
    the cached part it would fetch from slower tiers weighted by the worker's own costs
    (`prefill_cost`), plus its queued work times `queue_weight`. The queue weighs less than the
    prompt (by default a quarter) because a queue is one instant's noisy view of the wait while
    a cached prefix is work saved for sure, and because sending a request away from its cache
    makes the cluster compute the prefix again: under load that extra work delays everyone.

    Real overload is the bound's job, not the score's: a worker whose queued work, in seconds
    at its own reported speed (`queued_seconds`), exceeds `queue_factor` times the least-queued
    worker's plus `queue_slack_s` gets no request, however well its cache matches, and neither
    does one whose request count exceeds the least-loaded worker's by more than `abs_threshold`
    *and* by a factor above `rel_threshold` (a backstop for load signals that lag). A hot prefix
    then grows a second holder instead of a queue. A worker that was given more than
    `traffic_factor` times the mean number of recent requests over the candidates (plus two;
    decayed like the work below) is left out too, while others are not: a prefix hot enough to
    bring one worker that much more traffic than the rest is worth a copy elsewhere even before
    queues grow, and an ordinary group never gets there.

    Among the workers within bound whose score is within `tie_fraction` of the prompt's length
    of the best, the request goes to the one that was given the least work lately (prefill
    tokens routed to it, decayed with a half-life of `work_half_life_s` seconds). So a request
    that nobody holds much of (a new conversation, or one whose only match is a system prompt
    every worker holds) starts its group where work has been lightest, and groups spread by
    the work they bring rather than by the queues of one instant; a request that a worker holds
    a real part of stays there.

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
    ) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self.queue_factor = queue_factor
        self.queue_slack_s = queue_slack_s
        self.queue_weight = queue_weight
        self.tie_fraction = tie_fraction
        self.work_half_life_s = work_half_life_s
        self.traffic_factor = traffic_factor
        self._recency = _Recency()
        self._work = RecentAmounts(work_half_life_s)  # prefill tokens routed lately
        self._traffic = RecentAmounts(work_half_life_s)  # requests routed lately

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        for recent in (self._work, self._traffic):
            recent.advance(request.now_s, (c.worker for c in candidates))
        loaded = self._within_load_bound(request, candidates)
        eligible = self._within_traffic_bound(loaded, candidates)
        scores = {
            c.worker: self.queue_weight * c.num_queued_tokens + prefill_cost(request, c)
            for c in eligible
        }
        best = min(scores.values())
        limit = best + self.tie_fraction * request.num_prompt_tokens
        near = [c for c in eligible if scores[c.worker] <= limit]
        pick = min(
            near,
            key=lambda c: (
                self._work.get(c.worker),
                scores[c.worker],
                self._recency.age_key(c.worker),
                c.worker,
            ),
        )
        reason = _reason(pick, candidates, loaded, eligible, lowest=scores[pick.worker] == best)
        pulled = pull_blocks(request, pick)
        if pulled:
            reason += f"; pulls {pulled} blocks from the holder"
        self._recency.chosen(pick.worker)
        self._work.add(pick.worker, prefill_cost(request, pick))
        self._traffic.add(pick.worker, 1.0)
        cost = estimated_cost(request, pick)
        return RouteDecision(pick.worker, self.name, _matched(pick), cost, reason, pulled)

    def _within_traffic_bound(
        self, loaded: list[Candidate], candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        """Leave out of `loaded` the workers that got far more than the mean of recent
        requests over all `candidates` (workers that left routing weigh nothing), unless that
        would leave nobody."""
        if self.traffic_factor <= 0:
            return loaded
        mean = self._traffic.mean(c.worker for c in candidates)
        ceiling = max(self.traffic_factor * mean, mean + _TRAFFIC_SLACK)
        light = [c for c in loaded if self._traffic.get(c.worker) <= ceiling]
        return light or loaded

    def _within_load_bound(
        self, request: RouteRequest, candidates: Sequence[Candidate]
    ) -> list[Candidate]:
        least_requests = min(c.num_requests for c in candidates)
        queued = queued_seconds(request, candidates)
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


def queued_seconds(request: RouteRequest, candidates: Sequence[Candidate]) -> dict[WorkerId, float]:
    """Each candidate's queued work in seconds: its queued tokens at its own reported prefill
    speed (`BlockCosts.compute_s` per block). One that reports none is taken to be as fast as
    the median of those that do (the same model, most likely the same hardware), or as
    `UNREPORTED_S_PER_TOKEN` when none does."""
    rates = {
        c.worker: c.costs.compute_s / request.block_size
        for c in candidates
        if c.costs is not None and c.costs.compute_s > 0
    }
    fallback = statistics.median(rates.values()) if rates else UNREPORTED_S_PER_TOKEN
    return {c.worker: c.num_queued_tokens * rates.get(c.worker, fallback) for c in candidates}


def _reason(
    pick: Candidate,
    candidates: Sequence[Candidate],
    loaded: Sequence[Candidate],
    eligible: Sequence[Candidate],
    lowest: bool,
) -> str:
    """Why `pick`: what it holds compared with the longest cached prefix anywhere, which bound
    left the holders out if one did, and how it won (the lowest score, or the least recent
    work among near ties)."""
    how = "lowest estimated ttft" if lowest else "least recent work among near ties"
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
