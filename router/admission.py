"""Admission: refuse a request the cluster cannot start within a time-to-first-token target,
rather than queue it where it would miss the target and delay everything behind it.

Past capacity a queue only grows: every request admitted waits behind more work than the
last, until none meets its target (in the simulated P/D sweeps, under 1% of the requests
within the SLO at 1.2 of capacity, in every mode). Refusing the ones predicted to start too
late keeps the queue at what the target allows, so the requests admitted meet it, and the
client learns at once (`RESOURCE_EXHAUSTED`, HTTP 429) that it should retry later or
elsewhere: Mooncake's early rejection, an SLO-aware load shedder's rule.

The prediction is the one `router.pd.decide` makes: the prefill work queued where the prompt
will run, and the prompt's own uncached tokens, at that worker's calibrated seconds per token.
The router (`router.core`) and the simulator (`cachesvc.sim.loop`) both call `refusal`.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter

from router.costs import UNREPORTED_S_PER_TOKEN
from router.domain import Exhausted
from router.metrics import RequestOutcome
from router.policy import RouteDecision
from router.pool import WorkerPool
from router.worker_state import WorkerState


def predicted_ttft_s(queued_tokens: int, uncached_tokens: int, token_s: float) -> float:
    """Seconds until a prompt's first token where `queued_tokens` of prefill are ahead of it
    and it computes `uncached_tokens` itself, at `token_s` seconds a token."""
    return (queued_tokens + uncached_tokens) * token_s


def token_s(state: WorkerState, block_size: int) -> float:
    """A worker's seconds of prefill per token, from its calibrated costs (an H100's for an 8B
    model when it reports none: `router.costs.UNREPORTED_S_PER_TOKEN`)."""
    costs = state.load.block_costs
    if costs is None or costs.compute_s <= 0:
        return UNREPORTED_S_PER_TOKEN
    return costs.compute_s / block_size


def worker_ttft_s(state: WorkerState, num_tokens: int, held_blocks: int, block_size: int) -> float:
    """A prompt of `num_tokens` predicted on a live worker holding `held_blocks` of it."""
    uncached = max(0, num_tokens - held_blocks * block_size)
    return predicted_ttft_s(state.num_queued_tokens, uncached, token_s(state, block_size))


@dataclass(frozen=True)
class Admission:
    """The router's admission target: refuse a request predicted to wait longer than
    `ttft_s` for its first token (None: admit everything)."""

    ttft_s: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_s is not None and self.ttft_s <= 0:
            raise ValueError(f"admit_ttft_ms must be positive, got {self.ttft_s * 1e3:g}")

    def refusal(self, predicted_s: float) -> str | None:
        """Why a request predicted to get its first token in `predicted_s` seconds is
        refused, or None when it is admitted."""
        if self.ttft_s is None or predicted_s <= self.ttft_s:
            return None
        return (
            f"the cluster is past its capacity: predicted time to first token "
            f"{predicted_s * 1e3:.0f} ms exceeds admit_ttft_ms {self.ttft_s * 1e3:.0f} ms; "
            "retry later"
        )


class Gate:
    """The router's admission: `check` raises `Exhausted` (RESOURCE_EXHAUSTED, HTTP 429) for
    a request predicted to start later than `admit_ttft_ms` (None: admits every request),
    counts it in `refused` and puts the reason in its request log."""

    def __init__(self, pool: WorkerPool, admit_ttft_ms: float | None, refused: Counter) -> None:
        self.pool = pool
        self.admission = Admission(None if admit_ttft_ms is None else admit_ttft_ms / 1e3)
        self.refused = refused

    def check(self, predicted_s: float, outcome: RequestOutcome) -> None:
        """Refuse a request predicted to get its first token in `predicted_s` seconds, when
        that is too late."""
        refusal = self.admission.refusal(predicted_s)
        if refusal is not None:
            self.refused.inc()
            outcome.route_reason = refusal
            raise Exhausted(refusal)

    def check_placed(
        self, decision: RouteDecision, num_tokens: int, outcome: RequestOutcome
    ) -> None:
        """`check` a prompt of `num_tokens` placed as `decision` says (its worker, the blocks it
        holds)."""
        if self.admission.ttft_s is None:
            return
        state, block_size = self.pool.state(decision.worker), self.pool.model.block_size
        self.check(worker_ttft_s(state, num_tokens, decision.matched_blocks, block_size), outcome)
