"""The simulator against live runs, figure by figure: what `cachesvc bench sim-agreement` prints.

A figure is one number both report for the same workload: a policy's hit ratio or TTFT
percentile in `cachesvc bench routing`, a setup's inter-token gap or long-prompt TTFT
percentile in `cachesvc bench pd`. Live runs on a shared machine vary, so a figure keeps every
run's value and is judged on their median: latencies agree when the simulated one is within
`LATENCY_TOLERANCE` of it (relative), hit ratios within `HIT_TOLERANCE` (absolute).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from cachesvc.sim.report import SimSummary
from cachesvc.workloads.pd import WITH_PROMPTS, PhaseResult
from cachesvc.workloads.routing_report import PolicyResult
from cachesvc.workloads.table import format_table, percentile

LATENCY_TOLERANCE = 0.15
HIT_TOLERANCE = 0.02
HIT_RATIO = "hit ratio"


@dataclass(frozen=True)
class Figure:
    """One figure, live (each run) and simulated."""

    bench: str  # "routing" | "pd"
    row: str  # the policy, or the setup and phase
    name: str  # "hit ratio", "TTFT p50 ms", ...
    live: tuple[float, ...]
    simulated: float
    # Simulated again for each live run with the profile slowed by that run's measured
    # slowdown (other work on the machine): the simulator's own error, the machine's load aside.
    at_speed: tuple[float, ...] = ()

    @property
    def live_median(self) -> float:
        return statistics.median(self.live)

    @property
    def error(self) -> float:
        """Simulated against the live median: a difference for a hit ratio, else relative
        (-0.2: the simulator is 20% below)."""
        return self._error(self.simulated)

    @property
    def at_speed_error(self) -> float | None:
        """The same for the median of `at_speed` (None without it)."""
        return self._error(statistics.median(self.at_speed)) if self.at_speed else None

    @property
    def agrees(self) -> bool:
        return within(self.error, self.tolerance)

    @property
    def tolerance(self) -> float:
        return HIT_TOLERANCE if self.name == HIT_RATIO else LATENCY_TOLERANCE

    def _error(self, simulated: float) -> float:
        if self.name == HIT_RATIO:
            return simulated - self.live_median
        return simulated / self.live_median - 1 if self.live_median else float("inf")


def routing_figures(
    live_runs: Sequence[Sequence[PolicyResult]], simulated: Sequence[SimSummary]
) -> list[Figure]:
    """Per policy: hit ratio and client TTFT p50 / p99."""
    figures = []
    for sim in simulated:
        runs = [next(r for r in run if r.policy == sim.policy) for run in live_runs]
        for name, live, value in (
            (HIT_RATIO, [r.hit_ratio for r in runs], sim.hit_ratio),
            ("TTFT p50 ms", [r.ttft_p50_ms for r in runs], sim.ttft_p50_ms),
            ("TTFT p99 ms", [r.ttft_p99_ms for r in runs], sim.ttft_p99_ms),
        ):
            figures.append(Figure("routing", sim.policy, name, tuple(live), value))
    return figures


def pd_figures(
    live_runs: Sequence[Sequence[PhaseResult]], simulated: Sequence[PhaseResult]
) -> list[Figure]:
    """Per setup and phase: the decodes' gap p50 / p99; with long prompts their TTFT p50 /
    p99 too."""
    figures = []
    for i, sim in enumerate(simulated):
        runs = [run[i] for run in live_runs]
        assert all((r.setup, r.phase) == (sim.setup, sim.phase) for r in runs), "same order"
        row = f"{sim.setup}, {sim.phase}"
        series = [("ITL p50 ms", "gaps_s", 50), ("ITL p99 ms", "gaps_s", 99)]
        if sim.phase == WITH_PROMPTS:
            series += [("long TTFT p50 ms", "ttft_s", 50), ("long TTFT p99 ms", "ttft_s", 99)]
        for name, attr, q in series:
            live = tuple(percentile(getattr(r, attr), q) * 1e3 for r in runs)
            value = percentile(getattr(sim, attr), q) * 1e3
            figures.append(Figure("pd", row, name, live, value))
    return figures


def format_figures(figures: Sequence[Figure]) -> str:
    """The table, then how many figures agree, as profiled and at the machine's speed."""
    headers = ["bench", "row", "figure", "live runs", "live median", "simulated", "error"]
    headers += ["at its speed", "error"]
    rows = []
    for f in figures:
        speed = statistics.median(f.at_speed) if f.at_speed else None
        rows.append(
            [
                f.bench,
                f.row,
                f.name,
                ", ".join(_value(f.name, v) for v in f.live),
                _value(f.name, f.live_median),
                _value(f.name, f.simulated),
                _error(f.name, f.error),
                "-" if speed is None else _value(f.name, speed),
                "-" if f.at_speed_error is None else _error(f.name, f.at_speed_error),
            ]
        )
    profiled = _summary("as profiled", [f.error for f in figures], figures)
    lines = [format_table(headers, rows), profiled]
    if all(f.at_speed for f in figures):
        speed_errors = [f.at_speed_error or 0.0 for f in figures]
        lines.append(_summary("at each run's speed", speed_errors, figures))
    return "\n".join(lines)


def within(error: float, tolerance: float) -> bool:
    """|error| <= tolerance, to float rounding (0.53 - 0.51 is within 0.02)."""
    return abs(error) <= tolerance + 1e-9


def _summary(what: str, errors: Sequence[float], figures: Sequence[Figure]) -> str:
    agree = sum(within(e, f.tolerance) for e, f in zip(errors, figures, strict=True))
    latency = [abs(e) for e, f in zip(errors, figures, strict=True) if f.name != HIT_RATIO]
    return (
        f"{what}: {agree} of {len(figures)} figures agree (latencies within "
        f"{LATENCY_TOLERANCE:.0%} of the live median, hit ratios within {HIT_TOLERANCE}); "
        f"largest latency error {max(latency, default=0.0):.0%}"
    )


def _error(name: str, error: float) -> str:
    return f"{error:+.2f}" if name == HIT_RATIO else f"{error * 100:+.0f}%"


def _value(name: str, value: float) -> str:
    return (
        f"{value:.2f}" if name == HIT_RATIO else f"{value:.0f}" if value >= 100 else f"{value:.1f}"
    )
