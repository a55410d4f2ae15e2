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
    """

    name = "prefix_aware"

    def __init__(self, abs_threshold: int = 8, rel_threshold: float = 1.5) -> None:
        self.abs_threshold = abs_threshold
        self.rel_threshold = rel_threshold
        self._recency = _Recency()

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        eligible = self._within_bound(candidates)
        costs = {c.worker: estimated_cost(request, c) for c in eligible}
        pick = min(
            eligible,
            key=lambda c: (
                costs[c.worker],
                c.num_requests,
                self._recency.age_key(c.worker),
                c.worker,
            ),
        )
        self._recency.chosen(pick.worker)
        reason = "lowest estimated ttft"
        if len(eligible) < len(candidates):
            reason += " within the load-imbalance bound"
        return RouteDecision(pick.worker, self.name, _matched(pick), costs[pick.worker], reason)

    def _within_bound(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        least = min(c.num_requests for c in candidates)
        return [
            c
            for c in candidates
            if c.num_requests - least <= self.abs_threshold
            or c.num_requests <= least * self.rel_threshold
        ]


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
