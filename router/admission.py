"""Admission: refuse a request the cluster cannot start within a time-to-first-token target,
rather than queue it where it would miss the target and delay everything behind it.

Past capacity a queue only grows: every request admitted waits behind more work than the
last, until none meets its target (in the simulated P/D sweeps, under 1% of the requests
within the SLO at 1.2 of capacity, in every mode). Refusing the ones predicted to start too
late keeps the queue at what the target allows, so the requests admitted meet it, and the
client learns at once (`RESOURCE_EXHAUSTED`, HTTP 429) that it should retry later or
elsewhere: Mooncake's early rejection, an SLO-aware load shedder's rule.

The prediction is the one `router.pd.decide` makes: the prefill work queued where the prompt
will run, and the prompt's own uncached tokens, at that worker's calibrated seconds per token,
scaled by what admitted requests actually took against their predictions (`TTFTScale`). Raw,
it leaves out the decode steps between a queue's prefill chunks, the hops, and on a worker
that reports no costs the hardware itself; scaled, the target is the TTFT itself. The router
(`Gate`) and the simulator (`cachesvc.sim.loop`) both decide with `CalibratedAdmission`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import Counter

from router.costs import prefill_token_s
from router.domain import Exhausted
from router.metrics import RequestOutcome
from router.pd import PDDecision
from router.policy import RouteDecision
from router.pool import WorkerPool
from router.worker_state import WorkerState


def predicted_ttft_s(queued_tokens: int, uncached_tokens: int, token_s: float) -> float:
    """Seconds until a prompt's first token where `queued_tokens` of prefill are ahead of it
    and it computes `uncached_tokens` itself, at `token_s` seconds a token."""
    return (queued_tokens + uncached_tokens) * token_s


def worker_ttft_s(
    state: WorkerState, num_tokens: int, held_blocks: int, block_size: int
) -> tuple[float, float]:
    """A prompt of `num_tokens` on a live worker holding `held_blocks` of it: its predicted
    TTFT, and the part of it queued ahead of it (seconds)."""
    uncached = max(0, num_tokens - held_blocks * block_size)
    per_token = prefill_token_s(state.load.block_costs, block_size)
    queued = state.num_queued_tokens
    return predicted_ttft_s(queued, uncached, per_token), queued * per_token


def queued_s(decision: PDDecision) -> float:
    """Of a P/D decision's predicted TTFT, the part queued ahead of the prompt where it runs."""
    return max(0.0, decision.predicted_ttft_s - decision.prefill_s)


@dataclass(frozen=True)
class Admission:
    """The router's admission target: refuse a request predicted to wait longer than
    `ttft_s` for its first token (None: admit everything)."""

    ttft_s: float | None = None

    def __post_init__(self) -> None:
        if self.ttft_s is not None and self.ttft_s <= 0:
            raise ValueError(f"admit_ttft_ms must be positive, got {self.ttft_s * 1e3:g}")

    def refusal(self, predicted_s: float, queued_s: float) -> str | None:
        """Why a request predicted to get its first token in `predicted_s` seconds, `queued_s`
        of them waiting for work ahead of it, is refused, or None when it is admitted. With
        nothing ahead it is always admitted: refusing it protects no queue (and its first
        token is what the prediction's scale learns from)."""
        if self.ttft_s is None or predicted_s <= self.ttft_s or queued_s <= 0:
            return None
        return (
            f"the cluster is past its capacity: predicted time to first token "
            f"{predicted_s * 1e3:.0f} ms exceeds admit_ttft_ms {self.ttft_s * 1e3:.0f} ms; "
            "retry later"
        )


# The weight of each admitted request's measurement in `TTFTScale`.
SCALE_WEIGHT = 0.05


@dataclass
class TTFTScale:
    """Measured seconds to first token per predicted second, over recent admitted requests:
    the ratio of the two exponentially decayed sums (1.0 before any). A ratio of sums, not a
    mean of ratios: long prompts weigh most, and a cached prompt's prediction of a few
    milliseconds (its hop alone takes more) does not swing it."""

    predicted_s: float = 0.0
    measured_s: float = 0.0

    def observe(self, predicted_s: float, measured_s: float) -> None:
        """An admitted request predicted `predicted_s` (raw) got its first token after
        `measured_s`."""
        if predicted_s <= 0 or measured_s < 0:
            return
        first = self.predicted_s == 0
        weight = 1.0 if first else SCALE_WEIGHT
        self.predicted_s += weight * (predicted_s - self.predicted_s)
        self.measured_s += weight * (measured_s - self.measured_s)

    @property
    def factor(self) -> float:
        return self.measured_s / self.predicted_s if self.predicted_s > 0 else 1.0


@dataclass
class CalibratedAdmission:
    """`Admission` on predictions scaled by `TTFTScale`."""

    admission: Admission
    scale: TTFTScale = field(default_factory=TTFTScale)

    @property
    def on(self) -> bool:
        return self.admission.ttft_s is not None

    def scaled(self, predicted_s: float) -> float:
        """A raw prediction as admission judges it."""
        return predicted_s * self.scale.factor

    def refusal(self, predicted_s: float, queued_s: float) -> str | None:
        """Why a request predicted (raw) `predicted_s`, `queued_s` of it queued ahead, is
        refused, or None."""
        return self.admission.refusal(self.scaled(predicted_s), queued_s)


class Gate:
    """The router's admission: `check` raises `Exhausted` (RESOURCE_EXHAUSTED, HTTP 429) for
    a request predicted to start later than `admit_ttft_ms` (None: admits every request),
    counts it in `refused` and puts the reason in its request log; `observe` learns the
    prediction's scale from each admitted request's first token."""

    def __init__(self, pool: WorkerPool, admit_ttft_ms: float | None, refused: Counter) -> None:
        self.pool = pool
        ttft_s = None if admit_ttft_ms is None else admit_ttft_ms / 1e3
        self.admission = CalibratedAdmission(Admission(ttft_s))
        self.refused = refused

    def check(self, predicted_s: float, queued_s: float, outcome: RequestOutcome) -> None:
        """Refuse a request predicted (raw) to get its first token in `predicted_s` seconds
        (`queued_s` of them behind other work), when that is too late; else remember the
        prediction to learn from."""
        if not self.admission.on:
            return
        scaled_s = self.admission.scaled(predicted_s)
        outcome.admit_predicted_ttft_ms = round(scaled_s * 1e3, 2)
        refusal = self.admission.admission.refusal(scaled_s, queued_s)
        if refusal is not None:
            self.refused.inc()
            outcome.route_reason = refusal
            raise Exhausted(refusal)
        outcome.admit_predicted_s = predicted_s

    def check_placed(
        self, decision: RouteDecision, num_tokens: int, outcome: RequestOutcome
    ) -> None:
        """`check` a prompt of `num_tokens` placed as `decision` says (its worker, the blocks it
        holds)."""
        if not self.admission.on:
            return
        state, block_size = self.pool.state(decision.worker), self.pool.model.block_size
        predicted, queued = worker_ttft_s(state, num_tokens, decision.matched_blocks, block_size)
        self.check(predicted, queued, outcome)

    def check_planned(self, decision: PDDecision, outcome: RequestOutcome) -> None:
        """`check` a request as the P/D plan placed it (handed off: on its prefill worker)."""
        self.check(decision.predicted_ttft_s, queued_s(decision), outcome)

    def observe(self, outcome: RequestOutcome) -> None:
        """The request's first token came: its TTFT against its prediction."""
        predicted = outcome.admit_predicted_s
        if predicted is not None and outcome.ttft_s is not None:
            self.admission.scale.observe(predicted, outcome.ttft_s)
