"""One request's prefill/decode plan as the router carries it through the request: the
decision, the placements, what the prefill phase brought back, and the hand-off's timing and
merged usage.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cachesvc.types import WorkerId
from router.metrics import RequestOutcome, RouterMetrics
from router.pd import PDDecision
from router.placement import Placed
from router.policy import RouteDecision
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
    # Told each measured hand-off (seconds) with the part of the prediction that scales with
    # the request (seconds), to learn the fixed part.
    calibrate: Callable[[float, float], None] | None = None
    _placed: list[Placed] = field(default_factory=list)

    def take(self) -> Placed | None:
        """The placement of the first attempt after planning (None afterwards: route anew)."""
        return self._placed.pop() if self._placed else None

    def observe(self, delta: StreamDelta, metrics: RouterMetrics, outcome: RequestOutcome) -> None:
        """Time the hand-off at the decode worker's first delta (once): measured against
        predicted, in the metrics and the request's log line."""
        if not self.handed_off or self.first_token_s is None or outcome.pd_handoff_ms is not None:
            return
        measured_s = time.perf_counter() - self.first_token_s
        outcome.pd_handoff_ms = round(measured_s * 1e3, 2)
        predicted_s = self.decision.handoff_s
        if predicted_s > 0:
            metrics.pd_error.labels("handoff").observe(measured_s / predicted_s)
        if self.calibrate is not None:
            self.calibrate(measured_s, predicted_s - self.decision.handoff_fixed_s)

    def merged(self, delta: StreamDelta) -> StreamDelta:
        """The decode worker's last delta with the whole request's usage: the prompt's cached
        and computed tokens as the prefill worker counted them (the decode worker's tail
        added), and the KV it pulled."""
        if not self.handed_off or delta.usage is None or self.prefill_usage is None:
            return delta
        first, last = self.prefill_usage, delta.usage
        usage = dataclasses.replace(
            last,
            cached_tokens=dict(first.cached_tokens),
            computed_tokens=first.computed_tokens + last.computed_tokens,
            ttft_ms=first.ttft_ms,
            lossy_kv=first.lossy_kv or last.lossy_kv,
            prefill_worker_id=first.worker_id,
            kv_transfer_tokens=last.cached_tokens.get(PEER_TOKENS, 0),
        )
        return dataclasses.replace(delta, usage=usage)
