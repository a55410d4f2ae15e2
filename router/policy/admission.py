"""Admission: refuse a request the cluster cannot start within a time-to-first-token target,
rather than queue it where it would miss the target and delay everything behind it.

Past capacity a queue only grows: every request admitted waits behind more work than the
last, until none meets its target (in the simulated P/D sweeps, under 1% of the requests
within the SLO at 1.2 of capacity, in every mode). Refusing the ones predicted to start too
late keeps the queue at what the target allows, so the requests admitted meet it, and the
client learns at once (`RESOURCE_EXHAUSTED`, HTTP 429) that it should retry later or
elsewhere: Mooncake's early rejection, an SLO-aware load shedder's rule.

The prediction is the one `router.policy.pd.decide` makes: the prefill work queued where the prompt
will run, and the prompt's own uncached tokens, at that worker's calibrated seconds per token,
scaled by what admitted requests actually took against their predictions (`TTFTScale`). Raw,
it leaves out the decode steps between a queue's prefill chunks, the hops, and on a worker
that reports no costs the hardware itself; scaled, the target is the TTFT itself. The router
(`router.request.gate.Gate`) and the simulator (`cachesvc.sim.loop`) both decide with
`CalibratedAdmission`; this module holds the rules alone, pure.

TTFT is half of what a client is promised. A worker can start every prompt in time and still
spend so much of its steps on prompts that the streams it decodes miss their inter-token target
(a mixed worker past capacity: the sweeps' ITL met fell to 0.33). With an inter-token target as
well (`admit_itl_ms`), a request is also refused when a worker whose streams it would join or
stall already decodes them slower than the target (`router.policy.stream_gaps`, measured), plus what
its own prefill takes from each of them spread over an answer: Mooncake's decode-side
rejection. A worker with no streams never refuses this way.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.policy.pd import PDDecision


def predicted_ttft_s(queued_tokens: int, uncached_tokens: int, token_s: float) -> float:
    """Seconds until a prompt's first token where `queued_tokens` of prefill are ahead of it
    and it computes `uncached_tokens` itself, at `token_s` seconds a token."""
    return (queued_tokens + uncached_tokens) * token_s


def queued_s(decision: PDDecision) -> float:
    """Of a P/D decision's predicted TTFT, the part queued ahead of the prompt where it runs."""
    return max(0.0, decision.predicted_ttft_s - decision.prefill_s)


@dataclass(frozen=True)
class Admission:
    """The router's admission target: refuse a request predicted to wait longer than
    `ttft_s` for its first token (None: admit everything)."""

    ttft_s: float | None = None
    # The streams' target: refuse a request that would join or stall streams decoding slower
    # than `itl_s` a token (None: never refuse for them).
    itl_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("admit_ttft_ms", self.ttft_s), ("admit_itl_ms", self.itl_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value * 1e3:g}")

    @property
    def on(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

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

    def itl_refusal(
        self, gap_s: float | None, stall_s: float, mean_answer: float, num_streams: int
    ) -> str | None:
        """Why a request that would join (or stall, by `stall_s` each) the `num_streams`
        streams of a worker whose recent mean gap between tokens is `gap_s` (None: unknown)
        is refused, or None. Predicted: that gap, plus the stall spread over the gaps of an
        answer of `mean_answer` tokens."""
        if self.itl_s is None or gap_s is None or num_streams <= 0:
            return None
        predicted_s = gap_s + max(0.0, stall_s) / max(1.0, mean_answer - 1)
        if predicted_s <= self.itl_s:
            return None
        return (
            f"the worker's streams are past their inter-token target: predicted mean gap "
            f"{predicted_s * 1e3:.1f} ms (lately {gap_s * 1e3:.1f} ms) exceeds admit_itl_ms "
            f"{self.itl_s * 1e3:.0f} ms; retry later"
        )


# What admission on the streams sees of a worker a request touches: its name, its streams'
# recent mean gap between tokens (None: none lately), what each would lose to the request, and
# how many there are.
TouchedStreams = tuple[str, float | None, float, int]


def streams_refusal(
    admission: Admission, touched: Iterable[TouchedStreams], mean_answer: float
) -> str | None:
    """The first of the `touched` workers whose streams refuse the request (`itl_refusal`),
    named in the reason; None when none does."""
    for worker, gap_s, stall_s, num_streams in touched:
        refusal = admission.itl_refusal(gap_s, stall_s, mean_answer, num_streams)
        if refusal is not None:
            return f"{refusal} (worker {worker})"
    return None


def admission_targets(ttft_ms: float | None, itl_ms: float | None) -> Admission:
    """Admission at targets in milliseconds (None: none)."""
    return Admission(
        None if ttft_ms is None else ttft_ms / 1e3, None if itl_ms is None else itl_ms / 1e3
    )


def admission_of(config: RouterConfig) -> Admission:
    """The router's targets, from its configuration."""
    return admission_targets(config.admit_ttft_ms, config.admit_itl_ms)


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
        return self.admission.on

    def scaled(self, predicted_s: float) -> float:
        """A raw prediction as admission judges it."""
        return predicted_s * self.scale.factor

    def refusal(self, predicted_s: float, queued_s: float) -> str | None:
        """Why a request predicted (raw) `predicted_s`, `queued_s` of it queued ahead, is
        refused, or None."""
        return self.admission.refusal(self.scaled(predicted_s), queued_s)


# A worker a request's placement touches, and the decode time each stream there loses to it:
# where it decodes (its prefill, colocated; the hand-off's tail and landing, handed off), and
# where its prompt is computed.
Stall = tuple[WorkerId, float]
W = TypeVar("W")  # a worker, as the caller knows it (the router by id, the simulator itself)


def stalls_of(
    decision: PDDecision, kept: W, prefill: W | None, decode: W | None
) -> list[tuple[W, float]]:
    """The workers a P/D `decision` touches, and what each of their streams loses to it:
    colocated, the policy's choice `kept`; handed off, its `decode` worker and its `prefill`
    worker."""
    if not decision.disaggregate or prefill is None or decode is None:
        return [(kept, decision.colocated_prefill_s)]
    return [(decode, decision.decode_stall_s), (prefill, decision.disaggregated_prefill_s)]
