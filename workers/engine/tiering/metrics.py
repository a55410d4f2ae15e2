"""The tiering's counters (`TieringStats`) and the flat view of them, of the tiers' and of the
plans' timing that a metrics endpoint reports (`tiering_metrics`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachesvc.kv.tiers.tier_manager import TierManager
from workers.engine.tiering.peer import PeerPuller
from workers.engine.tiering.plan_timing import PlanTimer


@dataclass
class TieringStats:
    plans: dict[str, int] = field(default_factory=dict)  # plan kind -> requests
    loaded_blocks: int = 0
    failed_blocks: int = 0  # planned to fetch, computed instead (miss or corrupt)


def tiering_metrics(
    manager: TierManager, stats: TieringStats, timer: PlanTimer, peers: PeerPuller | None
) -> dict[str, float]:
    """Flat counters: per tier (its counters, and levels such as the Redis write queue's depth
    and breaker), per plan kind (with the predicted and measured seconds of timed plans), block
    moves, and the pulls from peers once peers are attached. Reads only."""
    out: dict[str, float] = {
        f"{t.name}_{k}": v
        for t in manager.all_tiers
        for k, v in (t.stats.as_dict() | t.gauges()).items()
    }
    out.update({f"plan_{kind}": n for kind, n in stats.plans.items()})
    m = manager.stats
    out.update(
        demoted=m.demoted,
        dropped=m.dropped,
        shared=m.shared,
        lossy_refused=m.lossy_refused,
        loaded_blocks=stats.loaded_blocks,
        failed_blocks=stats.failed_blocks,
    )
    out.update(timer.metrics())
    if peers is not None:
        out.update(peers.stats.as_dict())
    return out
