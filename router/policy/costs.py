"""What a routing policy sees of a request and of each live worker, and what the request would
cost on each: tokens of prefill (cached blocks in slower tiers and pulled blocks weighted by the
worker's own costs) and the worker's speed. Pure functions of the candidates.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from workers.protocol import BlockCosts

# Cost of bringing one cached token into the device pool, relative to recomputing it (1.0), for
# a worker that does not report its own (`BlockCosts`: only workers with lower tiers do).
TIER_FETCH_COST: Mapping[str, float] = {"hbm": 0.0, "dram": 0.05, "nvme": 0.2, "redis": 0.3}
_UNKNOWN_TIER_COST = 0.5
PEER = "peer"  # the pseudo-tier of a pull from another worker, in `BlockCosts.fetch_s`
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
    # The worker the request's affinity key went to last (`router.request.affinity`): `prefix_aware`
    # sends it there while that worker is within its bounds. None: no key, or a new one.
    affinity: WorkerId | None = None


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


def prefill_token_s(costs: BlockCosts | None, block_size: int) -> float:
    """Seconds of prefill per token from a worker's reported costs (`BlockCosts.compute_s` per
    block), or `UNREPORTED_S_PER_TOKEN` when it reports none."""
    if costs is None or costs.compute_s <= 0:
        return UNREPORTED_S_PER_TOKEN
    return costs.compute_s / block_size


def seconds_per_token(
    request: RouteRequest, candidates: Sequence[Candidate]
) -> dict[WorkerId, float]:
    """Each candidate's seconds of prefill per token, from its reported costs
    (`BlockCosts.compute_s` per block). One that reports none is taken to be as fast as the
    median of those that do (the same model, most likely the same hardware), or as
    `UNREPORTED_S_PER_TOKEN` when none does."""
    rates = {
        c.worker: c.costs.compute_s / request.block_size
        for c in candidates
        if c.costs is not None and c.costs.compute_s > 0
    }
    fallback = statistics.median(rates.values()) if rates else UNREPORTED_S_PER_TOKEN
    return {c.worker: rates.get(c.worker, fallback) for c in candidates}
