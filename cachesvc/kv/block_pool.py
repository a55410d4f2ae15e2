"""The device block pool: reference counts, an ordered set of free blocks, and a hash map.

A block is the unit of paging and of prefix caching. A block with a reference count of zero sits
in the free queue; if it still holds a registered hash it is a *cached* free block that a later
request may revive, and it is evicted (its hash dropped) only when it is handed out again. The
queue's order is an eviction policy's (`cachesvc.kv.eviction`): least recently freed first by
default (`lru`); it hears of every free (`push`, with the parent block) and every reuse of a
block (`pull`). No I/O lives here.

The eviction hook (the tiers' demotion) runs only once the pool's own bookkeeping is complete, and
a hook that fails is a counted miss: the pool never ends up half-updated by someone else's error.

A block may carry a lossy mark (`mark_lossy`): its KV is not what the model computes (it landed
from a quantized tier, or was computed over such KV). The mark belongs to the block id, not the
hash: it holds while the block does, through its eviction hook, and is cleared when the block is
handed out again for new KV (or its hash dropped by `reset_cache`).

Retention and tenant quotas (`cachesvc.kv.retention_book`): every registered block has an owner
(the tenant of the request that registered it) and may carry a retention (`retain`). The free
queue orders retention classes (`ClassedPolicy`): unretained blocks go first, the policy orders
within a class. While the pool must evict, a tenant over its soft share (`set_quotas`) gives up
its own blocks first. A block's retention, like its lossy mark, is readable in its eviction hook
(`retention_of`), so the tiers below keep it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from cachesvc.kv.events import TIER_HBM, EventLog
from cachesvc.kv.eviction.classes import ClassedPolicy
from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import NUM_CLASSES, Retention
from cachesvc.kv.retention_book import RetentionBook
from cachesvc.kv.types import BlockHash, BlockId

_log = logging.getLogger(__name__)
_LOG_EVERY_S = 10.0  # at most one log line per this many seconds for failing hooks


class NoFreeBlocksError(RuntimeError):
    """Fewer blocks are free right now than were asked for (raised by `allocate`); blocks come
    back as requests end, so the same request may succeed later."""


@dataclass
class _Block:
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # kept to confirm a hash hit (collision guard)
    parent: BlockHash | None = None  # hash of the block before it, for the tiers' chains


@dataclass(frozen=True)
class _Evicted:
    """A cached block that just lost its hash; its KV stays intact until `allocate` returns."""

    block_id: BlockId
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    parent: BlockHash | None
    retention: Retention | None
    tenant: str


# Called with (block id, hash, token ids, parent hash) after a cached block lost its hash (the
# pool is consistent again) and before the block is handed out, so its KV is still intact: the
# tiers copy it out (demotion). An exception from it is counted and logged, never raised.
EvictHook = Callable[[BlockId, BlockHash, tuple[int, ...], "BlockHash | None"], None]


class BlockPool:
    """Fixed set of `num_blocks` block ids with ref counts, reuse in the order of eviction
    policy `policy` (a name of `cachesvc.kv.eviction.base.POLICY_NAMES`) and hash registration."""

    def __init__(
        self,
        num_blocks: int,
        events: EventLog | None = None,
        policy: str = "lru",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks = [_Block() for _ in range(num_blocks)]
        # The free blocks, the next one handed out first: unretained, then by retention class.
        self._free: ClassedPolicy[BlockId] = ClassedPolicy(policy, NUM_CLASSES)
        for i in range(num_blocks):
            self._free.push(BlockId(i))
        # Registered blocks' owners and retentions; it moves blocks between the free queue's
        # classes as their retentions start and end (`_retention_changed`).
        self._book: RetentionBook[BlockId] = RetentionBook(
            policy, num_blocks, clock, on_change=self._retention_changed
        )
        self._leaving: dict[BlockId, _Evicted] = {}  # evicted, hook not run yet
        self._by_hash: dict[BlockHash, BlockId] = {}
        self.events = events if events is not None else EventLog()
        self.on_evict: EvictHook | None = None
        self.num_evict_hook_failures = 0  # hook calls that raised: demotions missed
        self._demoting: set[BlockHash] = set()  # evicted, hook not run yet (see `contains`)
        self._lossy: set[BlockId] = set()  # blocks whose KV is lossy (see `mark_lossy`)
        self._last_failure_log = -_LOG_EVERY_S

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out now (cached free blocks included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks that carry a registered hash, in use or free."""
        return len(self._by_hash)

    def ref_count(self, block_id: BlockId) -> int:
        return self._blocks[block_id].ref_cnt

    def allocate(self, num: int, tenant: str | None = None) -> list[BlockId]:
        """Take `num` blocks (ref count 1) for `tenant` (who will register them: under quotas,
        a tenant at its share evicts its own blocks first), evicting cached free blocks in the
        policy's order.

        Raises NoFreeBlocksError, changing nothing, when fewer than `num` are free. The eviction
        hook runs for each evicted block after all of them are taken and unregistered.
        """
        if num > len(self._free):
            raise NoFreeBlocksError(f"asked for {num} blocks, {len(self._free)} free")
        out: list[BlockId] = []
        evicted: list[_Evicted] = []
        self._book.expire()
        for _ in range(num):
            block_id = self._victim(tenant, num)
            self._blocks[block_id].ref_cnt = 1
            out.append(block_id)
            dropped = self._drop_hash(block_id)
            if dropped is not None:
                evicted.append(dropped)
            else:  # a block that held nothing: the policy need not remember it was evicted
                self._free.discard(block_id)
        self._run_evict_hook(evicted)  # the hook still sees the evicted blocks' marks
        self._lossy.difference_update(out)  # handed out for new KV
        return out

    def _victim(self, tenant: str | None, num: int) -> BlockId:
        """The next block to hand out: the queue's next, unless that evicts a cached block
        while a tenant is over its soft share (`tenant`, taking `num` blocks now, counted with
        them): then that tenant's least recent unretained block (one under its share borrows
        free room freely; the room is reclaimed from whoever is over)."""
        if self._book.has_quotas:
            nxt = self._free.peek(1)
            if nxt and self._blocks[nxt[0]].block_hash is not None:
                over = self._book.quota_victim(tenant, num)
                if over is not None:
                    self._free.discard(over)
                    return over
        return self._free.pop()

    def free(self, block_ids: Sequence[BlockId], evict_first: bool = False) -> None:
        """Drop one reference from each block; a block reaching zero joins the free queue.

        Blocks are freed in the given order, so pass a request's blocks tail first: the tail of
        a prefix is then evicted before its head. `evict_first`: they join at the queue's
        front instead, evicted before any block freed earlier (a copy another worker keeps).
        """
        front: list[BlockId] = []
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_cnt > 0, f"double free of block {block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                parent = self._parent_id(block)
                self._free.push(block_id, parent, block.block_hash)
                if block.block_hash is not None:
                    self._book.push(block_id, parent)
                front.append(block_id)
        if evict_first:
            for block_id in reversed(front):  # the first freed ends at the very front
                self._free.to_front(block_id)

    def touch(self, block_ids: Sequence[BlockId]) -> None:
        """Add a reference to each block, taking free ones out of the free queue (a reuse, for
        the eviction policy)."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            self._free.pull(block_id)
            if block.ref_cnt == 0 and block.block_hash is not None:
                self._book.pull(block_id)
            block.ref_cnt += 1

    def _parent_id(self, block: _Block) -> BlockId | None:
        """The block holding `block`'s parent, for a policy that orders by prefix chains."""
        return None if block.parent is None else self._by_hash.get(block.parent)

    def register(
        self,
        block_id: BlockId,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent: BlockHash | None = None,
        tenant: str = "",
    ) -> bool:
        """Record that `block_id` holds (or is about to hold) the KV of a full block, owned by
        `tenant` (whose soft share it counts against).

        A hash that is already registered keeps its first block: the duplicate stays private.
        Emits BlockStored with `parent`, the hash of the block before it (None for the first).
        Returns whether the block was registered (False: it holds a hash, or the hash is taken).
        """
        block = self._blocks[block_id]
        assert block.ref_cnt > 0, "only an allocated block can be registered"
        if block.block_hash is not None or block_hash in self._by_hash:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent = parent
        self._by_hash[block_hash] = block_id
        self._book.add(block_id, 1, self._parent_id(block), tenant=tenant)
        self._book.pull(block_id)  # in use: no victim until freed
        self.events.stored(TIER_HBM, (block_hash,), parent)
        return True

    def unregister(self, block_ids: Iterable[BlockId]) -> int:
        """Forget the hashes of blocks whose KV will never be written (a failed step), so that
        nothing matches them; the blocks stay with their owners. No hook runs: there is nothing
        to demote. Emits one BlockRemoved; returns how many hashes were dropped."""
        dropped: list[BlockHash] = []
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.block_hash is not None:
                dropped.append(block.block_hash)
                del self._by_hash[block.block_hash]
                self._book.remove(block_id)
                block.block_hash, block.token_ids, block.parent = None, (), None
                if block.ref_cnt > 0:  # its history goes (new KV next); a free one stays free
                    self._free.discard(block_id)
        if dropped:
            self.events.removed(TIER_HBM, tuple(dropped))
        return len(dropped)

    # ---- retention and quotas -------------------------------------------------------------

    def retain(self, block_ids: Sequence[BlockId], retention: Retention) -> int:
        """Retain registered blocks (a block retained already keeps the stronger claim), the
        last first: past the tenant's budget its oldest retentions are demoted, so a prompt
        longer than the budget keeps its head. Blocks without a hash are skipped. Returns how
        many of `block_ids` are not retained afterwards (trimmed by the budget, or no hash)."""
        for block_id in reversed(block_ids):
            if self._blocks[block_id].block_hash is not None:
                self._book.retain(block_id, retention)
        return sum(self.retention_of(b) is None for b in block_ids)

    def retention_of(self, block_id: BlockId) -> Retention | None:
        """The block's unexpired retention; readable in the eviction hook (the block's last)."""
        leaving = self._leaving.get(block_id)
        if leaving is not None:
            return leaving.retention
        return self._book.retention_of(block_id) if block_id in self._book else None

    def tenant_of(self, block_id: BlockId) -> str | None:
        """The registered block's owner (also in the eviction hook); None without a hash."""
        leaving = self._leaving.get(block_id)
        if leaving is not None:
            return leaving.tenant
        return self._book.tenant_of(block_id) if block_id in self._book else None

    def set_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:
        """Tenants' soft shares and retention budgets from now on (not named: no quota)."""
        self._book.set_quotas(quotas)

    def close_session(self, tenant: str, session: str) -> int:
        """End the retentions of `tenant`'s `session`; returns how many blocks."""
        return len(self._book.end_session(tenant, session))

    def expire(self) -> int:
        """End the retentions past their expiry (also done lazily); returns how many."""
        return self._book.expire()

    def tenant_blocks(self) -> dict[str, TenantBlocks]:
        """Each tenant's registered blocks and, of them, retained ones."""
        return self._book.tenant_blocks()

    def _retention_changed(self, block_id: BlockId, retention: Retention | None) -> None:
        self._free.set_class(block_id, 0 if retention is None else retention.cls)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> BlockId | None:
        """The block registered under `block_hash` whose tokens equal `token_ids`, or None."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self._blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def mark_lossy(self, block_ids: Iterable[BlockId]) -> None:
        """Mark blocks as holding lossy KV, until they are handed out again."""
        self._lossy.update(block_ids)

    def is_lossy(self, block_id: BlockId) -> bool:
        return block_id in self._lossy

    def any_lossy(self, block_ids: Iterable[BlockId]) -> bool:
        """Whether any of `block_ids` is marked lossy (cheap when none is marked anywhere)."""
        return bool(self._lossy) and not self._lossy.isdisjoint(block_ids)

    def contains(self, block_hash: BlockHash) -> bool:
        """Whether the device holds the KV of `block_hash` (no collision check): a block is
        registered under it, or it was just evicted and its hook has not run yet (its KV still
        in place). The tiers read this to keep a demoted block's prefix counted as held."""
        return block_hash in self._by_hash or block_hash in self._demoting

    def block_hash(self, block_id: BlockId) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def reset_cache(self, demote: bool = True) -> int:
        """Forget every hash of a free block, least recently freed first; returns how many were
        dropped. With `demote` the eviction hook copies each one out first (into the tiers);
        without it they are simply gone. Blocks in use keep their hashes."""
        evicted = [
            dropped
            for block_id in list(self._free)
            if (dropped := self._drop_hash(block_id)) is not None
        ]
        if not self._by_hash:
            self.events.cleared(TIER_HBM)
        if demote:
            self._run_evict_hook(evicted)
        self._lossy.difference_update(e.block_id for e in evicted)  # after the hook read them
        return len(evicted)

    def _drop_hash(self, block_id: BlockId) -> _Evicted | None:
        """Unregister a block (emitting BlockRemoved); what the hook needs of it, if it had one."""
        block = self._blocks[block_id]
        if block.block_hash is None:
            return None
        retention, tenant = self._book.retention_of(block_id), self._book.tenant_of(block_id)
        out = _Evicted(block_id, block.block_hash, block.token_ids, block.parent, retention, tenant)
        self._book.remove(block_id)  # its class goes back to 0 before the queue forgets it
        del self._by_hash[block.block_hash]
        self.events.removed(TIER_HBM, (block.block_hash,))
        block.block_hash, block.token_ids, block.parent = None, (), None
        return out

    def _run_evict_hook(self, evicted: Sequence[_Evicted]) -> None:
        """Call the hook for each evicted block, in eviction order (a chain's tail first, as
        requests free tail first). Until its own call a block counts as held (`contains`), so a
        tier may move the block's already demoted suffix down meanwhile."""
        hook = self.on_evict
        if hook is None or not evicted:
            return
        self._demoting.update(e.block_hash for e in evicted)
        try:
            for e in evicted:
                self._leaving[e.block_id] = e
                try:
                    hook(e.block_id, e.block_hash, e.token_ids, e.parent)
                except Exception:
                    self._hook_failed()
                self._demoting.discard(e.block_hash)
                del self._leaving[e.block_id]
        finally:
            self._demoting.clear()  # an interrupt leaves none marked either
            self._leaving.clear()

    def _hook_failed(self) -> None:
        self.num_evict_hook_failures += 1
        now = time.monotonic()
        if now - self._last_failure_log >= _LOG_EVERY_S:
            self._last_failure_log = now
            _log.warning(
                "evict hook failed (%d failures so far); the block is dropped, not demoted",
                self.num_evict_hook_failures,
                exc_info=True,
            )

    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the pool (or its policy) is broken."""
        self._free.check_integrity()
        self._book.check_integrity()
        free = set(self._free)
        assert len(free) == len(self._free)
        for i, block in enumerate(self._blocks):
            assert block.ref_cnt >= 0, f"block {i} has negative ref count"
            assert (block.ref_cnt == 0) == (BlockId(i) in free), f"block {i} free-queue mismatch"
            if block.block_hash is not None:
                assert self._by_hash.get(block.block_hash) == i, f"block {i} hash not mapped"
                assert BlockId(i) in self._book, f"block {i} has no owner"
                retention = self._book.retention_of(BlockId(i))
                cls = 0 if retention is None else retention.cls
                assert self._free.class_of(BlockId(i)) == cls, f"block {i} in the wrong class"
            else:
                assert BlockId(i) not in self._book, f"block {i} owned without a hash"
        for block_hash, block_id in self._by_hash.items():
            assert self._blocks[block_id].block_hash == block_hash
        for block_hash in self._demoting:
            assert block_hash not in self._by_hash, "a block being demoted is still registered"
        assert all(0 <= b < self.num_blocks for b in self._lossy), "lossy mark on no block"
