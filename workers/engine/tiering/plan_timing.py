"""How long each load plan took against its prediction: logged per request, summed per kind.

A plan is timed from the moment it is made (the request's prefix match, as it is admitted) to
the moment the request's whole prompt is computed, which is what `LoadPlan.predicted_s`
predicts. A preempted request computes part of its prompt twice, so its time says nothing of
the plan and is not counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from cachesvc.kv.planner import LoadPlan
from cachesvc.kv.types import RequestId
from workers.engine.request import Request

_log = logging.getLogger(__name__)


@dataclass
class PlanTotals:
    """Per plan kind: timed plans and the sums of predicted and measured seconds."""

    count: dict[str, int] = field(default_factory=dict)
    predicted_s: dict[str, float] = field(default_factory=dict)
    actual_s: dict[str, float] = field(default_factory=dict)

    def add(self, kind: str, predicted_s: float, actual_s: float) -> None:
        self.count[kind] = self.count.get(kind, 0) + 1
        self.predicted_s[kind] = self.predicted_s.get(kind, 0.0) + predicted_s
        self.actual_s[kind] = self.actual_s.get(kind, 0.0) + actual_s


class PlanTimer:
    """Times the plans of requests in flight; `totals` holds what finished."""

    def __init__(self) -> None:
        self.totals = PlanTotals()
        self._open: dict[RequestId, tuple[LoadPlan, float]] = {}

    def start(self, request: Request, plan: LoadPlan) -> None:
        if plan.kind != "none":  # nothing below the device: nothing was planned
            self._open[request.request_id] = (plan, time.perf_counter())

    def on_computed(self, request: Request) -> None:
        """Close the request's plan once its prompt is computed."""
        opened = self._open.get(request.request_id)
        if opened is None or request.num_computed_tokens < request.num_prompt_tokens:
            return
        del self._open[request.request_id]
        if request.num_preemptions:
            return
        plan, started = opened
        actual_s = time.perf_counter() - started
        self.totals.add(plan.kind, plan.predicted_s, actual_s)
        _log.info(
            "request %s: plan %s (fetch %d blocks from %s, recompute %d), predicted %.1f ms, "
            "took %.1f ms",
            request.request_id,
            plan.kind,
            plan.num_fetch_blocks,
            "+".join(sorted({f.tier for f in plan.fetch})) or "-",
            plan.num_recompute_blocks,
            plan.predicted_s * 1e3,
            actual_s * 1e3,
        )

    def drop(self, request_id: RequestId) -> None:
        self._open.pop(request_id, None)

    def metrics(self) -> dict[str, float]:
        """`plan_<kind>_timed`, `plan_<kind>_predicted_s` and `plan_<kind>_actual_s`."""
        t = self.totals
        out: dict[str, float] = {}
        for kind, n in t.count.items():
            out[f"plan_{kind}_timed"] = n
            out[f"plan_{kind}_predicted_s"] = t.predicted_s[kind]
            out[f"plan_{kind}_actual_s"] = t.actual_s[kind]
        return out
