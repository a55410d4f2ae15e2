"""Goodput under a latency SLO: how many requests a second a replay served within both targets,
time to first token (TTFT) and inter-token latency (ITL), and the latencies behind it.

A request's tokens are timed where they were produced: its first on the worker that computed
its prompt (a prefill worker, disaggregated), the rest on the worker that decoded it, so the
gap between the first and the second holds the handoff (the pull and the tail). Its ITL is the
mean of its gaps (time per output token after the first, as vLLM's `--goodput tpot:` and
DistServe count it); a one-token answer has none and meets any ITL target. The ITL
percentiles are over every gap of every request (a token's wait, as a streaming client sees
it), where a step that also computes prefill chunks shows up as a long gap.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cachesvc.sim.loop import SimRun
from cachesvc.sim.seq import SimSeq
from cachesvc.workloads.table import percentile


@dataclass(frozen=True)
class SLO:
    """Latency targets a request must meet both of to count in goodput."""

    ttft_ms: float = 2000.0
    itl_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError("--slo-ttft-ms and --slo-itl-ms must be positive")

    def stall_weight(self, mean_output: float) -> float:
        """What a second a decode stream loses weighs against a second of a request's own
        wait (`router.policy.pd.decide`'s `stall_weight`) under this SLO: each as a share of its
        budget, the TTFT target for the wait, the ITL target over an answer of
        `mean_output` tokens for the stream (its delay is spread over its tokens)."""
        return self.ttft_ms / (max(1.0, mean_output - 1) * self.itl_ms)


@dataclass(frozen=True)
class Outcome:
    """One request as its client saw it."""

    index: int
    ttft_s: float
    gaps_s: tuple[float, ...]  # between consecutive output tokens
    disaggregated: bool

    @property
    def itl_s(self) -> float:
        """Its mean inter-token latency (0.0 with one token)."""
        return statistics.fmean(self.gaps_s) if self.gaps_s else 0.0

    def meets(self, slo: SLO) -> bool:
        return self.ttft_s * 1e3 <= slo.ttft_ms and self.itl_s * 1e3 <= slo.itl_ms


def outcomes(run: SimRun) -> list[Outcome]:
    """Every finished request of `run`, by arrival: a disaggregated one's prefill and decode
    are one request."""
    decided = run.pd_routes.decisions if run.pd_routes is not None else {}
    out = []
    for seq in run.seqs:
        if seq.prefill_only:
            continue  # its decode (a seq of its own) carries its tokens on
        assert seq.finish_s is not None, "every routed request finishes"
        times = seq.token_times
        assert len(times) == seq.req.output_len, "one time per output token"
        decision = decided.get(seq.req.index)
        out.append(
            Outcome(
                seq.req.index,
                times[0] - seq.req.arrival_s,
                tuple(b - a for a, b in zip(times, times[1:], strict=False)),
                decision is not None and decision.disaggregate,
            )
        )
    return sorted(out, key=lambda o: o.index)


@dataclass(frozen=True)
class Goodput:
    """A replay's requests against an SLO."""

    num_requests: int
    num_good: int
    goodput_rps: float  # requests within both targets per second of the makespan
    ttft_met: float  # share of requests within the TTFT target
    itl_met: float  # share within the ITL target
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float  # over every gap of every request
    itl_p99_ms: float
    num_disaggregated: int
    makespan_s: float  # from the first arrival to the last token
    num_refused: int = 0  # refused by admission: counted in `num_requests`, never good

    @property
    def attainment(self) -> float:
        return self.num_good / self.num_requests if self.num_requests else 0.0


def goodput(run: SimRun, slo: SLO) -> Goodput:
    """`run`'s requests against `slo` (pure)."""
    done = outcomes(run)
    return measure(done, slo, _makespan(run.seqs), len(run.refused))


def measure(done: Sequence[Outcome], slo: SLO, makespan_s: float, num_refused: int = 0) -> Goodput:
    """Goodput and latencies of `done` requests served over `makespan_s` seconds, and
    `num_refused` more that admission refused (they meet no target; the latencies are the
    served requests')."""
    n = len(done) + num_refused
    good = sum(o.meets(slo) for o in done)
    ttfts = [o.ttft_s * 1e3 for o in done]
    gaps = [g * 1e3 for o in done for g in o.gaps_s]
    return Goodput(
        num_requests=n,
        num_good=good,
        goodput_rps=good / makespan_s if makespan_s > 0 else 0.0,
        ttft_met=sum(o.ttft_s * 1e3 <= slo.ttft_ms for o in done) / n if n else 0.0,
        itl_met=sum(o.itl_s * 1e3 <= slo.itl_ms for o in done) / n if n else 0.0,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(gaps, 50),
        itl_p99_ms=percentile(gaps, 99),
        num_disaggregated=sum(o.disaggregated for o in done),
        makespan_s=makespan_s,
        num_refused=num_refused,
    )


def _makespan(seqs: Sequence[SimSeq]) -> float:
    # A refused request never widens it: it was refused for work queued then, which ends
    # later, and the first request of all finds the cluster empty.
    if not seqs:
        return 0.0
    first = min(s.req.arrival_s for s in seqs)
    return max(s.finish_s or 0.0 for s in seqs) - first
