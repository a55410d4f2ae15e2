"""Where a request goes: the live candidates as a policy sees them, its choice, and the holder
a chosen worker may pull the prefix from.

`Placement` turns the pool's state and the prefix index's matches into `Candidate`s (with, when
pulls are on, the longest prefix another healthy worker holds), asks the policy, and names that
holder to the chosen worker (`HolderHint`). Pure reads of the pool; the metrics count hints.
"""

from __future__ import annotations

from cachesvc.types import BlockHash, WorkerId
from router.config import RouterConfig
from router.domain import Exhausted, Unavailable
from router.metrics import RouterMetrics
from router.policy import PEER, Candidate, Policy, RouteDecision, RouteRequest
from router.pool import WorkerPool
from workers.protocol import HolderHint


class Placement:
    """Chooses a worker for a request, and the holder it may pull the prefix from."""

    def __init__(
        self, pool: WorkerPool, policy: Policy, config: RouterConfig, metrics: RouterMetrics
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.config = config
        self.metrics = metrics

    def candidates_left(self, excluded: set[WorkerId]) -> bool:
        return any(s.worker_id not in excluded for s in self.pool.routable())

    def route(
        self, num_tokens: int, hashes: list[BlockHash], excluded: set[WorkerId]
    ) -> RouteDecision:
        live = [s for s in self.pool.routable() if s.worker_id not in excluded]
        if not live:
            raise Unavailable("no live worker to serve the request")
        limit = self.config.max_queued_per_worker
        if limit is not None:
            live = [s for s in live if s.num_requests < limit]
            if not live:
                raise Exhausted(f"every worker's queue is full ({limit} requests each)")
        matches = self.pool.index.longest_prefix(hashes)
        holders = self._holders(excluded) if self.config.peer_pull else {}
        held = {w: m.num_blocks for w, m in matches.items() if w in holders}
        candidates = [
            Candidate(
                s.worker_id,
                s.num_requests,
                s.num_queued_tokens,
                matches.get(s.worker_id),
                s.load.block_costs,
                max((n for w, n in held.items() if w != s.worker_id), default=0),
            )
            for s in live
        ]
        request = RouteRequest(num_tokens, self.pool.model.block_size)
        return self.policy.choose(request, candidates)

    def _holders(self, excluded: set[WorkerId]) -> dict[WorkerId, str]:
        """The healthy workers a peer may pull from, by their Ray actor names."""
        return {
            s.worker_id: s.info.actor_name
            for s in self.pool.healthy()
            if s.worker_id not in excluded and s.info is not None and s.info.actor_name
        }

    def holder_hint(
        self, decision: RouteDecision, hashes: list[BlockHash], excluded: set[WorkerId]
    ) -> HolderHint | None:
        """The healthy worker holding the longest prefix, when it holds more than the chosen
        one: the chosen worker's load planner may pull the difference from it
        (`EngineConfig.peer_pull`). None with `RouterConfig.peer_pull` off."""
        if not self.config.peer_pull:
            return None
        named = self._holders(excluded)
        named.pop(decision.worker, None)
        if not named:
            return None
        matches = [m for m in self.pool.index.longest_prefix(hashes).values() if m.worker in named]
        best = max(matches, key=lambda m: m.num_blocks, default=None)
        if best is None or best.num_blocks <= decision.matched_blocks:
            return None
        self.metrics.pull_hints.inc()
        return HolderHint(named[best.worker], best.num_blocks)

    def covered_blocks(self, decision: RouteDecision, holder: HolderHint | None) -> int:
        """Leading blocks of the request the chosen worker will not compute: those it holds,
        or those it may pull from `holder` when it pulls at all (reports a pull cost)."""
        covered = decision.matched_blocks
        costs = self.pool.state(decision.worker).load.block_costs
        if holder is not None and costs is not None and PEER in costs.fetch_s:
            covered = max(covered, holder.num_blocks)
        return covered
