"""Routing policies, picked by name from a registry: pure choices over candidate snapshots.

A policy sees, per live worker, its load and its cached prefix of the request (`Candidate`),
and returns a `RouteDecision`. Policies keep only tie-breaking state (who was chosen when), so
they are tested with tables of cases.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cachesvc.index import PrefixMatch
from cachesvc.types import WorkerId

# Cost of bringing one cached token into the device pool, relative to recomputing it (1.0).
TIER_FETCH_COST: Mapping[str, float] = {"hbm": 0.0, "dram": 0.05, "nvme": 0.2, "redis": 0.3}
_UNKNOWN_TIER_COST = 0.5


@dataclass(frozen=True)
class Candidate:
    """One live worker as a policy sees it."""

    worker: WorkerId
    num_requests: int  # running + waiting
    num_queued_tokens: int  # tokens still to compute ahead of a new request
    match: PrefixMatch | None = None  # its cached prefix of this request; None: nothing


@dataclass(frozen=True)
class RouteRequest:
    """What a policy knows of the request itself."""

    num_prompt_tokens: int
    block_size: int


@dataclass(frozen=True)
class RouteDecision:
    """Where a request goes and why."""

    worker: WorkerId
    policy: str
    matched_blocks: int = 0
    estimated_cost_tokens: float | None = None
    reason: str = ""


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
        pick = min(
            candidates,
            key=lambda c: (
                c.num_queued_tokens,
                c.num_requests,
                self._recency.age_key(c.worker),
                c.worker,
            ),
        )
        self._recency.chosen(pick.worker)
        return RouteDecision(pick.worker, self.name, _matched(pick), reason="least queued work")


def estimated_cost(request: RouteRequest, candidate: Candidate) -> float:
    """Tokens of work before the request's first token on `candidate`: its queue, the
    uncached part of the prompt to recompute, and the cached part to fetch from slower tiers."""
    match = candidate.match
    cached_blocks = 0 if match is None else match.num_blocks
    # The engine always computes the last prompt token itself, so a full match still costs one.
    matched = min(cached_blocks * request.block_size, max(request.num_prompt_tokens - 1, 0))
    fetch = 0.0
    if match is not None:
        for tier, num_blocks in match.blocks_by_tier.items():
            cost = TIER_FETCH_COST.get(tier, _UNKNOWN_TIER_COST)
            fetch += cost * num_blocks * request.block_size
    return candidate.num_queued_tokens + (request.num_prompt_tokens - matched) + fetch


class PrefixAware:
    """Minimum estimated time to first token, within a load-imbalance bound.

    A worker whose request count exceeds the least-loaded worker's by more than `abs_threshold`
    and by a factor above `rel_threshold` is left out, so one hot prefix cannot pile every
    request onto the worker that holds it (SGLang's cache-aware router uses the same test).
    The same bound holds over recent traffic (a decayed count of the requests this policy
    routed), and a request that no worker holds any of goes where recent traffic is lowest:
    with fast requests the queues of one instant are short, and groups would otherwise pile up
    on whichever worker happened to be idle when each group began.
    """

    name = "prefix_aware"

    # Each decision multiplies every worker's recent traffic by this: a half-life of about 35.
    TRAFFIC_DECAY = 0.98
    # A worker whose recent traffic exceeds the least's by this factor plus this many requests
    # gets no more for now, however well its cache matches.
    TRAFFIC_REL_SLACK = 1.2
    TRAFFIC_ABS_SLACK = 2.0

    def __init__(self, abs_threshold: int = 8, rel_threshold: float = 1.5) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self._recency = _Recency()
        self._traffic: dict[WorkerId, float] = {}  # decayed count of requests routed

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        eligible = self._within_bound(candidates)
        costs = {c.worker: estimated_cost(request, c) for c in eligible}
        bounded = len(eligible) < len(candidates)
        reason = "lowest estimated ttft"
        new_prefix = all(_matched(c) == 0 for c in eligible)
        if new_prefix:
            # Likely the first request of a new group: its followers will go where it goes.
            # Among the workers that would start it about as soon as the fastest (within one
            # prompt of queued work), take the one with the least recent traffic, so groups
            # spread evenly rather than by the queue lengths of one instant (SGLang sends such
            # requests to the worker with the smallest cache for the same reason).
            floor = min(costs.values())
            limit = floor + request.num_prompt_tokens
            eligible = [c for c in eligible if costs[c.worker] <= limit]
            reason = "no cached prefix: least recent traffic"
        pick = min(
            eligible,
            key=lambda c: (
                self._traffic.get(c.worker, 0.0) if new_prefix else 0.0,
                costs[c.worker],
                c.num_requests,
                self._recency.age_key(c.worker),
                c.worker,
            ),
        )
        self._recency.chosen(pick.worker)
        for worker in self._traffic:
            self._traffic[worker] *= self.TRAFFIC_DECAY
        self._traffic[pick.worker] = self._traffic.get(pick.worker, 0.0) + 1.0
        if bounded:
            reason += " within the load-imbalance bound"
        return RouteDecision(pick.worker, self.name, _matched(pick), costs[pick.worker], reason)

    def _within_bound(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        least = min(c.num_requests for c in candidates)
        now = [
            c
            for c in candidates
            if c.num_requests - least <= self.abs_threshold
            or c.num_requests <= least * self.rel_threshold
        ]
        # The same bound over recent traffic: queues of one instant are short when requests
        # are fast, yet a worker that keeps winning its prefixes ends up with most requests.
        traffic = {c.worker: self._traffic.get(c.worker, 0.0) for c in now}
        ceiling = min(traffic.values()) * self.TRAFFIC_REL_SLACK + self.TRAFFIC_ABS_SLACK
        return [c for c in now if traffic[c.worker] <= ceiling]


def _matched(candidate: Candidate) -> int:
    return 0 if candidate.match is None else candidate.match.num_blocks


_REGISTRY: dict[str, Callable[..., Policy]] = {
    RoundRobin.name: lambda **_: RoundRobin(),
    LeastLoaded.name: lambda **_: LeastLoaded(),
    PrefixAware.name: lambda **kw: PrefixAware(**kw),
}


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, *, abs_threshold: int = 8, rel_threshold: float = 1.5) -> Policy:
    """A fresh policy by registry name; raises ValueError listing the known names."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {policy_names()}")
    return factory(abs_threshold=abs_threshold, rel_threshold=rel_threshold)
