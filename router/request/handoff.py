"""One request's prefill/decode plan as the router carries it through the request: the
decision, the placements, what the prefill phase brought back, and the hand-off's timing and
merged usage (the learnt fixed cost of a hand-off is `router.policy.handoff_cost`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cachesvc.kv.types import WorkerId
from router.metrics import RequestOutcome, RouterMetrics
from router.policy.handoff_cost import HandoffCost
from router.policy.pd import PDDecision
from router.policy.routing import RouteDecision
from router.request.placement import Placed
from workers.protocol import PEER_TOKENS, StreamDelta, Usage


@dataclass
class Handoff:
    """One request's plan, and what its prefill phase brought back; mutated by the router."""

    decision: PDDecision
    colocated: Placed
    prefill: RouteDecision | None = None
    decode: WorkerId | None = None
    prefill_usage: Usage | None = None
    handed_off: bool = False
    first_token_s: float | None = None  # when the prefill worker's token reached the client
    # Learns the fixed part of hand-offs whose pull succeeded (None: nothing learns).
    cost: HandoffCost | None = None
    # Tokens of the prompt's full blocks: what a decode worker whose pull succeeded did not
    # compute itself.
    full_tokens: int = 0
    # Tells the prefill worker to let go of the prompt's KV it keeps pinned for the pull (set
    # while it keeps some); called once, when the decode worker has its prompt or the hand-off
    # does not happen.
    release: Callable[[], None] | None = None
    _placed: list[Placed] = field(default_factory=list)
    _residual_s: float | None = None  # measured hand-off less its predicted variable part

    def take(self) -> Placed | None:
        """The placement of the first attempt after planning (None afterwards: route anew)."""
        return self._placed.pop() if self._placed else None

    def let_go(self) -> None:
        """The prefill worker's pinned copy of the prompt is needed no more (idempotent)."""
        release, self.release = self.release, None
        if release is not None:
            release()

    def observe(self, delta: StreamDelta, metrics: RouterMetrics, outcome: RequestOutcome) -> None:
        """Time the hand-off at the decode worker's first delta (once): measured against
        predicted, in the metrics and the request's log line. The decode worker has the prompt
        by then: the prefill worker's pins are let go."""
        if not self.handed_off or self.first_token_s is None or outcome.pd_handoff_ms is not None:
            return
        self.let_go()
        measured_s = time.perf_counter() - self.first_token_s
        outcome.pd_handoff_ms = round(measured_s * 1e3, 2)
        predicted_s = self.decision.handoff_s
        if predicted_s > 0:
            metrics.pd_error.labels("handoff").observe(measured_s / predicted_s)
        self._residual_s = measured_s - (predicted_s - self.decision.handoff_fixed_s)

    def merged(self, delta: StreamDelta) -> StreamDelta:
        """The decode worker's last delta with the whole request's usage: the prompt's cached
        and computed tokens as the prefill worker counted them (the decode worker's tail
        added), and the KV it pulled. A hand-off whose pull succeeded (the decode worker
        computed none of the prompt's full blocks) is learnt from here."""
        if not self.handed_off or delta.usage is None or self.prefill_usage is None:
            return delta
        first, last = self.prefill_usage, delta.usage
        self._learn(last)
        usage = dataclasses.replace(
            last,
            cached_tokens=dict(first.cached_tokens),
            computed_tokens=first.computed_tokens + last.computed_tokens,
            cache_write_tokens=first.cache_write_tokens,  # the decode side pulled, wrote none
            ttft_ms=first.ttft_ms,
            lossy_kv=first.lossy_kv or last.lossy_kv,
            prefill_worker_id=first.worker_id,
            kv_transfer_tokens=last.cached_tokens.get(PEER_TOKENS, 0),
        )
        return dataclasses.replace(delta, usage=usage)

    def _learn(self, decoded: Usage) -> None:
        residual, self._residual_s = self._residual_s, None
        if residual is None or self.cost is None:
            return
        if sum(decoded.cached_tokens.values()) >= self.full_tokens:  # nothing recomputed
            self.cost.observe(residual, time.monotonic())
