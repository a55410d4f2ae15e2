"""The eviction replay's table, and the choice of a default policy from it.

The goal a default must meet: a hit ratio at least LRU's on every workload and size, and on
the multi-turn workload at least `GAP_GOAL` of the way from LRU to Belady at every size. When
no policy meets it, LRU stays the default and the verdict says by how much each one misses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cachesvc.sim.eviction import BELADY, ORACLES, UNBOUNDED, ReplayResult
from cachesvc.workloads.table import format_table

BASELINE = "lru"
GAP_WORKLOAD = "multi-turn"
GAP_GOAL = 1 / 3


@dataclass(frozen=True)
class PolicyVerdict:
    """How one policy fares against the goal."""

    policy: str
    worst_vs_lru: float  # min over workloads and sizes of (hit ratio - LRU's), in ratio units
    worst_at: str  # where that minimum is ("workload size%")
    gap_closed: dict[float, float]  # size % -> share of the LRU-to-Belady gap, multi-turn

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "worst_vs_lru_pts": 100 * self.worst_vs_lru,
            "worst_at": self.worst_at,
            "gap_closed_pct": {f"{s:g}": 100 * g for s, g in self.gap_closed.items()},
            "meets_goal": self.meets_goal,
        }

    @property
    def meets_goal(self) -> bool:
        return (
            self.worst_vs_lru >= 0
            and bool(self.gap_closed)
            and min(self.gap_closed.values()) >= GAP_GOAL
        )


def _by_cell(results: Sequence[ReplayResult]) -> dict[tuple[str, float], dict[str, float]]:
    """Hit ratios by (workload, size) and policy; each workload's unbounded one in every size."""
    unbounded = {r.workload: r.hit_ratio for r in results if r.policy == UNBOUNDED}
    cells: dict[tuple[str, float], dict[str, float]] = {}
    for r in results:
        if r.policy == UNBOUNDED:
            continue
        cells.setdefault((r.workload, r.size_pct), {UNBOUNDED: unbounded.get(r.workload, 0.0)})
        cells.setdefault((r.workload, r.size_pct), {})[r.policy] = r.hit_ratio
    return cells


def gap_closed(ratios: dict[str, float], policy: str) -> float:
    """The share of the gap from LRU to Belady that `policy` closes (1 when there is none)."""
    gap = ratios[BELADY] - ratios[BASELINE]
    return 1.0 if gap <= 0 else (ratios[policy] - ratios[BASELINE]) / gap


def verdicts(results: Sequence[ReplayResult]) -> list[PolicyVerdict]:
    """Each policy other than LRU and the oracles, against the goal."""
    others = (BASELINE, *ORACLES, UNBOUNDED)
    return _verdicts(results, [r.policy for r in results if r.policy not in others])


def bounds(results: Sequence[ReplayResult]) -> list[PolicyVerdict]:
    """The oracles short of Belady, measured as the policies are: how much of the gap knowing
    part of the future closes. Never a default."""
    return _verdicts(results, [r.policy for r in results if r.policy in ORACLES[:-1]])


def _verdicts(results: Sequence[ReplayResult], names: Sequence[str]) -> list[PolicyVerdict]:
    cells = _by_cell(results)
    out = []
    for policy in dict.fromkeys(names):
        diffs = {(w, s): c[policy] - c[BASELINE] for (w, s), c in cells.items()}
        (w, s), worst = min(diffs.items(), key=lambda kv: kv[1])
        gaps = {s: gap_closed(c, policy) for (w, s), c in cells.items() if w == GAP_WORKLOAD}
        out.append(PolicyVerdict(policy, worst, f"{w} {s:g}%", gaps))
    return out


def choose_default(results: Sequence[ReplayResult]) -> str:
    """The policy meeting the goal that closes most of the multi-turn gap at its worst size;
    LRU when none meets it."""
    meeting = [v for v in verdicts(results) if v.meets_goal]
    if not meeting:
        return BASELINE
    return max(meeting, key=lambda v: min(v.gap_closed.values())).policy


def format_report(results: Sequence[ReplayResult]) -> str:
    """Hit ratios (percent) per workload and size, a column per policy, the oracles' and an
    unbounded store's; then each policy's verdict, the oracles' short of Belady (`bounds`) and
    the default it leads to."""
    cells = _by_cell(results)
    policies = [*dict.fromkeys(r.policy for r in results if r.policy != UNBOUNDED), UNBOUNDED]
    capacity = {(r.workload, r.size_pct): r.capacity_blocks for r in results}
    rows = [
        [w, f"{s:g}%", capacity[(w, s)], *(100 * c[p] for p in policies)]
        for (w, s), c in cells.items()
    ]
    lines = [format_table(["workload", "size", "blocks", *policies], rows), ""]
    for v in [*verdicts(results), *bounds(results)]:
        gaps = ", ".join(f"{100 * g:.0f}% at {s:g}%" for s, g in v.gap_closed.items())
        verdict = "an offline bound" if v.policy in ORACLES else "misses the goal"
        verdict = "meets the goal" if v.meets_goal and v.policy not in ORACLES else verdict
        lines.append(
            f"{v.policy}: worst vs lru {100 * v.worst_vs_lru:+.2f} pts ({v.worst_at}); "
            f"closes of the {GAP_WORKLOAD} gap to belady: {gaps or 'n/a'}; {verdict}"
        )
    lines.append(f"default: {choose_default(results)}")
    return "\n".join(lines)
