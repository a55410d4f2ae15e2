"""A tenant's quota of a store of blocks, and the count of its blocks there.

The cache core's types (the worker's protocol re-exports them): every store below the router
(the device pool, DRAM, NVMe) applies the same quota per store, in that store's own units.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TenantQuota:
    """A tenant's soft share of each tier (a tenant under it borrows freely; one over it is
    evicted first), and of each tier for its retained blocks. 1.0 and 1.0: no quota."""

    share: float = 1.0
    retention_share: float = 0.5


@dataclass(frozen=True)
class TenantBlocks:
    """One tenant's blocks in one tier: registered (cached) and, of those, retained."""

    cached: int
    retained: int
