"""Moves blocks between the tiers below the device pool: demote, look up, fetch, share.

Worker-local tiers (DRAM, then NVMe) form a chain: a block evicted from the device lands in the
first that takes it; a tier that needs room pushes its victims one tier down, and the last one
drops them. Victims are picked least recently used *among leaves* (blocks none of whose children
is held), and a block that leaves every tier takes its held descendants with it: a suffix never
outlives its prefix, since nothing could ever reach it (LMCache's cost-aware policy admits it has
no such rule). The device pool counts as holding a parent, through `device_has`.

A hit is promoted by copying it into the device pool; the tiers keep their copy (inclusive), so
when the device evicts the block again it costs no new write.

A block's retention (`cachesvc.kv.retention`) comes with it from the device and moves down with
it from tier to tier; each local tier offers its victims in retention and quota order
(`retaining.RetainingTier`), unretained blocks and tenants over their share first, and the
manager still takes leaves first among them. Quotas apply per tier (`set_quotas`).

The shared tier (Redis) is written only for blocks reused at least `min_reuse` times, by the
manager's `Sharing` (`cachesvc/kv/tiers/sharing.py`); it is only ever asked, never managed.

Lossy KV (`Payload.lossy`: read from a quantized tier, or computed over such KV) goes only to
tiers of a quantized codec; a lossless tier skips it (`stats.lossy_refused`), so a block that
leaves a quantized tier for a lossless one below is dropped rather than stored as exact KV.

Every change is an event in the worker's `EventLog`: stored / moved / removed, naming the tier.
State lives on the caller's thread; only `read` (the fetch itself) may run on another thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from cachesvc.kv.codec import AuthError, Codec, KVBlock
from cachesvc.kv.events import EventLog
from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import Retention
from cachesvc.kv.tiers.base import Tier
from cachesvc.kv.tiers.payload import Payload
from cachesvc.kv.tiers.results import FetchResult, ManagerStats, TierHit, Transfer
from cachesvc.kv.tiers.sharing import Sharing
from cachesvc.kv.types import BlockHash

_VICTIM_SCAN = 64  # how many of a tier's oldest blocks to scan for a leaf


class TierManager:
    """The local tiers (fastest first), the optional shared tier, and where each block is."""

    def __init__(
        self,
        local: Sequence[Tier],
        shared: Tier | None,
        codecs: Mapping[str, Codec],
        events: EventLog,
        min_reuse: int = 2,
        device_has: Callable[[BlockHash], bool] = lambda h: False,
    ) -> None:
        self.local = list(local)
        self.shared = shared
        self.codecs = dict(codecs)
        self.events = events
        self.device_has = device_has
        self.stats = ManagerStats()
        self._where: dict[BlockHash, set[str]] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self._sharing = (
            None
            if shared is None
            else Sharing(shared, self.codecs[shared.name], events, self.stats, min_reuse)
        )
        self._by_name = {t.name: t for t in self.all_tiers}
        self._rebuild()

    @property
    def all_tiers(self) -> list[Tier]:
        return self.local + ([self.shared] if self.shared is not None else [])

    def tier(self, name: str) -> Tier:
        return self._by_name[name]

    def held_locally(self, block_hash: BlockHash) -> frozenset[str]:
        return frozenset(self._where.get(block_hash, ()))

    def held_by_tier(self) -> dict[str, list[BlockHash]]:
        """Every block the manager knows a tier holds, by tier name: what its events have said
        so far (a worker's snapshot for the router's index)."""
        out: dict[str, list[BlockHash]] = {}
        for h, tiers in self._where.items():
            for name in tiers:
                out.setdefault(name, []).append(h)
        return out

    def _rebuild(self) -> None:
        """Adopt what local tiers already hold (an NVMe folder after a restart), minus orphans."""
        for tier in self.local:
            for h, parent in tier.entries().items():
                self._record(h, parent, tier.name)
        self.drop_orphans()
        for tier in self.local:
            held = [h for h in tier.entries() if h in self._where]
            for h in held:
                self.events.stored(tier.name, (h,), self._parent[h])

    # ---- demotion ---------------------------------------------------------------------------

    def demote(
        self, block: KVBlock, retention: Retention | None = None, tenant: str | None = None
    ) -> bool:
        """Take a block leaving the device (its KV copied out) with its retention (None:
        unretained) and owner (None: its retention's tenant, else ""); False when no tier took
        it, in which case its held descendants are dropped too. A block held already keeps its
        copies, their retention merged with `retention`."""
        self.poll()
        payload = Payload(
            block.block_hash, block.parent, block=block, retention=retention, tenant=tenant
        )
        held = self._where.get(block.block_hash)
        landed = "held" if held else self._admit(0, payload)
        if held and retention is not None:
            for name in held:
                self.tier(name).retain(block.block_hash, retention)
        if self._sharing is not None:
            self._sharing.offer(payload)
        if landed is None:
            self._drop_descendants(block.block_hash)
            return False
        if landed != "held":
            self.stats.demoted += 1
            self.events.stored(landed, (block.block_hash,), block.parent)
        return True

    def _admit(self, level: int, payload: Payload) -> str | None:
        """Store in local tier `level` or a slower one; the name of the tier, None if none."""
        for tier in self.local[level:]:
            codec = self.codecs[tier.name]
            if payload.lossy and codec.lossless:
                # Stored losslessly it would read back as exact KV (here, after a restart, on
                # a peer): a quantized tier below may still keep it.
                self.stats.lossy_refused += 1
                continue
            data = payload.encoded(codec)
            if data is None:
                return None  # a corrupt blob is not demoted, it is dropped
            if not tier.fits_at_all(len(data)):
                continue
            if not self._make_room(tier, len(data), payload.retention):
                continue
            if payload.parent is not None and not self._is_held(payload.parent):
                return None  # making room dropped its prefix: it would be an orphan
            if tier.put([payload.item(data)]):
                self._record(payload.block_hash, payload.parent, tier.name)
                return tier.name
        return None

    def _make_room(self, tier: Tier, num_bytes: int, retention: Retention | None) -> bool:
        """Evict from `tier` until `num_bytes` fit; False when it cannot, or only by evicting
        a block that outranks the newcomer's `retention` (it then tries the tier below)."""
        while not tier.room_for(num_bytes):
            victim = self._victim(tier)
            if victim is None or tier.outranks(victim, retention):
                return False
            self._evict(tier, victim)
        return True

    def _victim(self, tier: Tier) -> BlockHash | None:
        """The least recently used unpinned leaf, else the least recently used unpinned."""
        candidates = [h for h in tier.oldest(_VICTIM_SCAN) if not tier.is_pinned(h)]
        for h in candidates:
            if not self._children.get(h):
                return h
        return candidates[0] if candidates else None

    def _evict(self, tier: Tier, block_hash: BlockHash) -> None:
        """Push a block one tier down (or drop it from the last), with its retention."""
        level = self.local.index(tier)
        retention, tenant = tier.retention_of(block_hash), tier.tenant_of(block_hash)
        [blob] = tier.pop([block_hash])
        parent = self._parent.get(block_hash)  # before `_unrecord` may forget it
        self._unrecord(block_hash, tier.name)
        lower = {t.name for t in self.local[level + 1 :]}
        if self._where.get(block_hash, set()) & lower or blob is None:
            landed = None  # already held below (or unreadable): nothing to copy
        else:
            source = self.codecs[tier.name]
            payload = Payload(
                block_hash, parent, blob=blob, source=source, retention=retention, tenant=tenant
            )
            landed = self._admit(level + 1, payload)
            if self._sharing is not None:
                self._sharing.offer(payload)
        if landed is not None:
            self.events.moved((block_hash,), tier.name, landed)
            return
        self.events.removed(tier.name, (block_hash,))
        if block_hash not in self._where:
            self.stats.dropped += 1
            self._drop_descendants(block_hash)

    # ---- bookkeeping ------------------------------------------------------------------------

    def _record(self, h: BlockHash, parent: BlockHash | None, tier: str) -> None:
        self._where.setdefault(h, set()).add(tier)
        self._parent[h] = parent
        if parent is not None:
            self._children.setdefault(parent, set()).add(h)

    def _unrecord(self, h: BlockHash, tier: str) -> None:
        held = self._where.get(h)
        if held is None:
            return
        held.discard(tier)
        if held:
            return
        del self._where[h]
        parent = self._parent.pop(h, None)
        siblings = self._children.get(parent) if parent is not None else None
        if siblings is not None:
            siblings.discard(h)
            if not siblings:
                del self._children[parent]  # type: ignore[arg-type]

    def _is_held(self, h: BlockHash) -> bool:
        return h in self._where or self.device_has(h)

    def _remove_everywhere(self, h: BlockHash) -> None:
        for name in sorted(self._where.get(h, ())):
            self.tier(name).remove([h])
            self._unrecord(h, name)
            self.events.removed(name, (h,))
        self.stats.dropped += 1
        self._drop_descendants(h)

    def drop_orphans(self) -> int:
        """Remove held blocks whose parent is held nowhere, device included (the device dropped
        it without demoting it), with their descendants; returns how many blocks went."""
        before = self.stats.dropped
        for h in [h for h, p in self._parent.items() if p is not None and not self._is_held(p)]:
            if h in self._where:  # not removed already as another orphan's descendant
                self._remove_everywhere(h)
        return self.stats.dropped - before

    def _drop_descendants(self, h: BlockHash) -> None:
        """`h` is gone from every tier (device included): its held descendants go too."""
        for child in sorted(self._children.get(h, ())):
            if child in self._where:
                self._remove_everywhere(child)

    def poll(self) -> None:
        """Account for blocks a tier lost in the background (a failed NVMe write, a shared write
        that failed), and forget what was shared once the shared tier failed (a restarted Redis
        kept nothing)."""
        if self._sharing is not None:
            self._sharing.poll()
        for tier in self.local:
            for h in tier.drain_lost():
                if tier.name in self._where.get(h, ()):
                    self._unrecord(h, tier.name)
                    self.events.removed(tier.name, (h,))
                    if not self._is_held(h):
                        self.stats.dropped += 1
                        self._drop_descendants(h)

    # ---- lookup and fetch -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash]) -> list[TierHit]:
        """Runs of leading `hashes` held below the device, each in the fastest tier holding it."""
        self.poll()
        hits: list[TierHit] = []
        pos = 0
        while pos < len(hashes):
            for tier in self.all_tiers:
                n = tier.contains_prefix(hashes[pos:])
                if n:
                    hits.append(TierHit(tier.name, pos, pos + n))
                    pos += n
                    break
            else:
                break
        return hits

    def pin(self, ranges: Sequence[tuple[str, Sequence[BlockHash]]]) -> None:
        for name, hashes in ranges:
            self.tier(name).pin(hashes)

    def unpin(self, ranges: Sequence[tuple[str, Sequence[BlockHash]]]) -> None:
        for name, hashes in ranges:
            self.tier(name).unpin(hashes)

    def read(self, ranges: Sequence[tuple[str, Sequence[BlockHash]]]) -> FetchResult:
        """Read and verify runs of blocks in order, stopping at the first that fails; a block
        whose signature fails is counted in its tier's `unverified`.

        Thread-safe (it only reads tiers); apply the result with `settle` on the owner's thread.
        """
        result = FetchResult()
        for name, hashes in ranges:
            start = time.perf_counter()
            tier = self.tier(name)
            blobs = tier.get(hashes)
            codec = self.codecs[name]
            ok = 0
            for h, blob in zip(hashes, blobs, strict=True):
                block = None if blob is None else codec.verify(blob, h)
                if not isinstance(block, KVBlock):
                    if isinstance(block, AuthError):
                        tier.stats.unverified += 1
                    result.bad.append((name, h))
                    break
                result.blocks.append(block)
                ok += 1
            num_bytes = sum(len(b) for b in blobs[:ok] if b is not None)
            result.transfers.append(Transfer(name, num_bytes, time.perf_counter() - start, ok))
            if ok < len(hashes):
                break
        return result

    def settle(self, result: FetchResult) -> None:
        """Count a fetch and forget the blocks that read back missing or corrupt."""
        for t in result.transfers:
            self.stats.fetched[t.tier] = self.stats.fetched.get(t.tier, 0) + t.num_blocks
        for name, h in result.bad:
            self.stats.failed[name] = self.stats.failed.get(name, 0) + 1
            tier = self.tier(name)
            if tier.shared:
                tier.remove([h])  # garbage under the key: delete it for every worker
            elif name in self._where.get(h, ()):
                tier.remove([h])
                self._unrecord(h, name)
                self.events.removed(name, (h,))
                if not self._is_held(h):
                    self.stats.dropped += 1
                    self._drop_descendants(h)

    # ---- reuse and the shared tier ----------------------------------------------------------

    @property
    def shares_lossy(self) -> bool:
        """Whether the shared tier takes lossy KV (its codec is quantized)."""
        return self.shared is not None and not self.codecs[self.shared.name].lossless

    def note_reuse(self, hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Count one reuse of each block; returns those that just became worth sharing (none
        without a shared tier)."""
        return [] if self._sharing is None else self._sharing.note_reuse(hashes)

    def share(self, block: KVBlock, retention: Retention | None = None) -> bool:
        """Write a block to the shared tier (once; a retained one to live until its retention
        ends); False when there is none or it failed."""
        payload = Payload(block.block_hash, block.parent, block=block, retention=retention)
        return self._sharing is not None and self._sharing.share(payload)

    def share_held(self, block_hash: BlockHash) -> bool:
        """Share a block held in a local tier (read from the fastest that has it)."""
        for name in [t.name for t in self.local if t.name in self._where.get(block_hash, ())]:
            [blob] = self.tier(name).get([block_hash])
            if blob is not None:
                tier = self.tier(name)
                parent, source = self._parent.get(block_hash), self.codecs[name]
                payload = Payload(
                    block_hash,
                    parent,
                    blob=blob,
                    source=source,
                    retention=tier.retention_of(block_hash),
                    tenant=tier.tenant_of(block_hash),
                )
                return self._sharing is not None and self._sharing.share(payload)
        return False

    # ---- retention and quotas ---------------------------------------------------------------

    def set_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:
        """Tenants' quotas of each local tier from now on (a tenant not named: `TenantQuota()`);
        retentions past a budget that shrank are demoted at once."""
        for tier in self.local:
            tier.set_quotas(quotas)

    def close_session(self, tenant: str, session: str) -> int:
        """End the retentions of a tenant's session in the local tiers (their blocks stay, as
        unretained ones); returns how many blocks it demoted, over all tiers."""
        return sum(tier.end_session(tenant, session) for tier in self.local)

    def tenant_blocks(self) -> dict[str, dict[str, TenantBlocks]]:
        """Each local tier's blocks per tenant (cached and retained), by tier name."""
        return {tier.name: tier.tenant_blocks() for tier in self.local}

    # ---- purge and spill --------------------------------------------------------------------

    def clear(self) -> dict[str, int]:
        """Drop every block of every tier (of the shared one: every block of its namespace,
        whoever wrote it); returns how many blocks each tier dropped, by tier name. Emits Cleared
        per tier. A fetch in flight from a cleared tier reads misses."""
        self.poll()
        counts = {tier.name: tier.clear() for tier in self.all_tiers}
        for name in counts:
            self.events.cleared(name)
        self._where.clear()
        self._parent.clear()
        self._children.clear()
        if self._sharing is not None:
            self._sharing.forget_sent()
        return counts

    def spill(self) -> None:
        """Move every block of the local tiers above the last one down into the last, least
        recently used first (before a graceful stop: NVMe outlives the process, DRAM does not).
        A block the last tier has no room for is dropped, as on eviction."""
        for tier in self.local[:-1]:
            for h in tier.oldest(len(tier.entries())):
                if tier.name in self._where.get(h, ()):  # not dropped with an evicted prefix
                    self._evict(tier, h)

    # ---- checks and shutdown ----------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if the maps disagree with the tiers or a suffix is orphaned."""
        for tier in self.local:
            tier.check_integrity()
            held = set(tier.entries())
            mine = {h for h, names in self._where.items() if tier.name in names}
            assert held == mine, f"{tier.name}: tier and manager disagree"
        for h, names in self._where.items():
            assert names, f"empty location set for {h.hex()}"
            parent = self._parent[h]
            assert parent is None or self._is_held(parent), f"orphaned block {h.hex()}"
            assert parent is None or h in self._children.get(parent, set())
        for parent, children in self._children.items():
            assert children and all(self._parent.get(c) == parent for c in children)

    def close(self) -> None:
        for tier in self.all_tiers:
            tier.close()
