"""What the tier manager reports: hits, transfers, fetch results, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from cachesvc.kv.codec import KVBlock
from cachesvc.kv.types import BlockHash


@dataclass(frozen=True)
class TierHit:
    """`hashes[start:end]` of a lookup are held by `tier` (a run, fastest tier first)."""

    tier: str
    start: int
    end: int

    @property
    def num_blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Transfer:
    """One measured read, for the planner's cost model."""

    tier: str
    num_bytes: int
    seconds: float
    num_blocks: int


@dataclass
class FetchResult:
    """The leading blocks of a fetch that read back valid; what failed, to settle later."""

    blocks: list[KVBlock] = field(default_factory=list)
    bad: list[tuple[str, BlockHash]] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)


@dataclass
class ManagerStats:
    demoted: int = 0  # blocks taken from the device into a tier
    dropped: int = 0  # blocks that left every local tier
    shared: int = 0  # blocks written to the shared tier
    lossy_refused: int = 0  # lossy blocks a tier of a lossless codec was not given
    fetched: dict[str, int] = field(default_factory=dict)  # blocks read back, per tier
    failed: dict[str, int] = field(default_factory=dict)  # planned reads that missed, per tier
