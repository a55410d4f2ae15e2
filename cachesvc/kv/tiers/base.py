"""The tier interface: one narrow, batched API over DRAM, NVMe and Redis; and a registry by name.

A tier stores opaque blobs (`cachesvc.kv.codec` output) under block hashes. It never raises into the
request path: a tier that fails (Redis down, disk full, corrupt file) answers as a miss and
counts it in `stats`. Worker-local tiers (`shared = False`) report their capacity and LRU order so
that the `TierManager` chooses victims itself (leaf first, so no suffix outlives its prefix);
a shared tier (Redis) evicts on its own and is only ever asked, never managed.

Tiers are thread-safe: the engine reads a tier from a background fetch thread while the step loop
demotes into it.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import Retention
from cachesvc.kv.types import BlockHash


@dataclass(frozen=True)
class TierItem:
    """A blob to store; `parent` is the hash of the block before it (None for a first block).
    `retention`: what its request asked to keep (kept after unretained blocks, until it
    expires); `tenant`: whose block it is, for that tenant's soft share (None: its retention's
    tenant, else no one's, "")."""

    block_hash: BlockHash
    parent: BlockHash | None
    data: bytes
    retention: Retention | None = None
    tenant: str | None = None


@dataclass
class TierStats:
    """Counters of one tier (metrics): hits and misses are counted per block."""

    hits: int = 0
    misses: int = 0
    errors: int = 0  # I/O or network failures turned into misses or refused writes
    stored: int = 0
    rejected: int = 0  # puts refused (no room, disk full, tier down)
    removed: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    unverified: int = 0  # blocks read back whose signature failed (forged, unsigned, other key)
    writes_dropped: int = 0  # writes dropped because the background write queue was full
    breaker_opens: int = 0  # times the tier was cut off after failing calls in a row
    restarts: int = 0  # times a shared tier's server was found restarted: it lost its blocks

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Throttle:
    """A sleep-based bandwidth cap, so tests and benchmarks can make a tier slow on purpose."""

    def __init__(self, mb_per_s: float | None) -> None:
        self.bytes_per_s = None if mb_per_s is None else mb_per_s * 1e6

    def wait(self, num_bytes: int) -> None:
        if self.bytes_per_s is not None and num_bytes:
            time.sleep(num_bytes / self.bytes_per_s)


class Tier(ABC):
    """A store of blobs keyed by block hash."""

    name: str = ""
    shared = False  # True: other workers write it too and it evicts by itself
    # True: its blobs live outside this process (files, a server), where others could change
    # them: with a tier key they are signed. DRAM is as trusted as the device pool.
    outside_process = False

    def __init__(self, cap_mb_per_s: float | None = None) -> None:
        self.stats = TierStats()
        self.throttle = Throttle(cap_mb_per_s)
        self._lock = threading.RLock()
        self._pins: dict[BlockHash, int] = {}

    @abstractmethod
    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading hashes of `hashes` this tier holds (0 when down). No mutation."""

    @abstractmethod
    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """The blob of each hash, None for a miss; marks hits as recently used. Blocks for I/O."""

    @abstractmethod
    def put(self, items: Sequence[TierItem]) -> list[BlockHash]:
        """Store blobs; returns the hashes now held. A hash already held is only touched.

        A local tier refuses an item it has no room for: the manager makes room first.
        """

    @abstractmethod
    def remove(self, hashes: Sequence[BlockHash]) -> None:
        """Forget blocks; unknown hashes are ignored."""

    def pop(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        """Remove blocks and return their blobs (None if absent), to demote them elsewhere."""
        out = self.get(hashes)
        self.remove(hashes)
        return out

    def clear(self) -> int:
        """Forget every block this tier holds; returns how many it held. A shared tier forgets
        every block of its namespace, whoever wrote it."""
        held = list(self.entries())
        self.remove(held)
        return len(held)

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Keep blocks from being chosen as victims until `unpin` (pins count)."""
        with self._lock:
            for h in hashes:
                self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for h in hashes:
                left = self._pins.get(h, 0) - 1
                if left > 0:
                    self._pins[h] = left
                else:
                    self._pins.pop(h, None)

    def is_pinned(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pins

    def gauges(self) -> dict[str, float]:
        """Current levels for metrics beside the `stats` counters (a write queue's depth, ...)."""
        return {}

    def close(self) -> None:  # noqa: B027  # most tiers hold nothing to release
        """Flush pending writes and release resources; the tier answers misses afterwards."""

    # ---- capacity, for local tiers (the manager's eviction policy reads these) --------------

    def room_for(self, num_bytes: int) -> bool:
        """Whether a blob of `num_bytes` fits now without evicting anything."""
        return True

    def fits_at_all(self, num_bytes: int) -> bool:
        """Whether a blob of `num_bytes` could ever fit (after evicting everything)."""
        return True

    def oldest(self, limit: int) -> list[BlockHash]:
        """Up to `limit` held hashes, least recently used first."""
        return []

    def entries(self) -> dict[BlockHash, BlockHash | None]:
        """Every held hash with its parent (for a local tier: rebuilt after a restart)."""
        return {}

    def drain_lost(self) -> list[BlockHash]:
        """Hashes accepted by `put` but lost since (a background write failed); forgets them."""
        return []

    # ---- retention and quotas, for local tiers (`retaining.RetainingTier`) ------------------

    def retention_of(self, block_hash: BlockHash) -> Retention | None:
        """A held block's unexpired retention (None: none, expired, not held, or a shared
        tier, which keeps none)."""
        return None

    def outranks(self, block_hash: BlockHash, retention: Retention | None) -> bool:
        """Whether a held block should stay rather than make room for a block of `retention`
        (a higher retention class, its owner within its share)."""
        return False

    def tenant_of(self, block_hash: BlockHash) -> str | None:
        """Whose a held block is (None: not held, or a shared tier)."""
        return None

    def retain(self, block_hash: BlockHash, retention: Retention) -> None:  # noqa: B027
        """Retain a held block (merged with its retention); a block not held is ignored."""

    def set_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:  # noqa: B027
        """Tenants' quotas of this tier from now on (a tenant not named: `TenantQuota()`)."""

    def end_session(self, tenant: str, session: str) -> int:
        """End the retentions of a tenant's session (back to unretained); returns how many."""
        return 0

    def tenant_blocks(self) -> dict[str, TenantBlocks]:
        """Each tenant's held and retained blocks ({} for a shared tier)."""
        return {}

    def check_integrity(self) -> None:  # noqa: B027  # most tiers keep no order of their own
        """Raise AssertionError if the tier's own structures disagree."""


TierFactory = Callable[..., Tier]
_REGISTRY: dict[str, TierFactory] = {}


def register_tier(name: str) -> Callable[[TierFactory], TierFactory]:
    """Class decorator: make a tier constructible by name."""

    def wrap(factory: TierFactory) -> TierFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def make_tier(name: str, **kwargs: object) -> Tier:
    """Build a registered tier; the implementation module is imported on first use (lazy)."""
    if name not in _REGISTRY:
        import importlib

        module = {"dram": "dram", "nvme": "nvme", "redis": "redis_tier"}.get(name)
        if module is None:
            raise KeyError(f"unknown tier {name!r}; known: dram, nvme, redis")
        importlib.import_module(f"cachesvc.kv.tiers.{module}")
    return _REGISTRY[name](**kwargs)
