"""A local tier whose victims come in retention and quota order (`RetainingTier`).

DRAM and NVMe keep their blocks in a `RetentionBook` (`cachesvc.kv.retention_book`): unretained
blocks are offered as victims first, tenants over their soft share before the rest, and each
tenant's retained blocks stay within its retention budget of the tier. The manager still picks
among the offered victims (leaves first, pins skipped) and moves a victim's retention down with
it.
"""

from __future__ import annotations

from collections.abc import Mapping

from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import Retention
from cachesvc.kv.retention_book import RetentionBook
from cachesvc.kv.tiers.base import Tier, TierItem
from cachesvc.kv.types import BlockHash


class RetainingTier(Tier):
    """The retention side of a local tier over `self._book`; the subclass adds, uses and
    removes its blocks in the book under `self._lock`."""

    _book: RetentionBook[BlockHash]

    def _add(self, item: TierItem, size: int) -> None:
        self._book.add(item.block_hash, size, item.parent, item.retention, item.tenant)

    def _touch(self, item: TierItem) -> None:
        """A put of a held block: a use, and its retention merged."""
        self._book.use(item.block_hash, item.parent)
        if item.retention is not None:
            self._book.retain(item.block_hash, item.retention)

    def oldest(self, limit: int) -> list[BlockHash]:
        """Up to `limit` held hashes, the next victim first (quotas, then retention order)."""
        with self._lock:
            return self._book.victims(limit)

    def retention_of(self, block_hash: BlockHash) -> Retention | None:
        with self._lock:
            return self._book.retention_of(block_hash)

    def outranks(self, block_hash: BlockHash, retention: Retention | None) -> bool:
        with self._lock:
            return block_hash in self._book and self._book.outranks(block_hash, retention)

    def tenant_of(self, block_hash: BlockHash) -> str | None:
        with self._lock:
            return self._book.tenant_of(block_hash) if block_hash in self._book else None

    def retain(self, block_hash: BlockHash, retention: Retention) -> None:
        with self._lock:
            if block_hash in self._book:
                self._book.retain(block_hash, retention)

    def set_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:
        with self._lock:
            self._book.set_quotas(quotas)

    def end_session(self, tenant: str, session: str) -> int:
        with self._lock:
            return len(self._book.end_session(tenant, session))

    def tenant_blocks(self) -> dict[str, TenantBlocks]:
        with self._lock:
            return self._book.tenant_blocks()

    def check_integrity(self) -> None:
        with self._lock:
            self._book.check_integrity()
