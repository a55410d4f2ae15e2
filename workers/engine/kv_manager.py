"""Block tables of requests over the device block pool, with prefix caching.

Every full block a request computes is registered under its rolling hash *when it is scheduled*,
before its KV is written (vLLM's trick): a request admitted later in the same step finds it and
computes only its own suffix, reading the shared blocks written earlier in the same layer pass.
That is in-batch prefix dedup; across steps the same registry gives ordinary prefix caching.
The price: when a step fails, the blocks it registered must be forgotten (`abort_step`) before
anything can match them, since their KV was never written.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.retention import Retention
from cachesvc.kv.types import BlockHash, BlockId
from workers.engine.request import Request

IN_BATCH_MODES = ("share", "defer", "ignore")
MAX_ROOTS = 4096  # root hashes kept, one per cache salt (tenant), least recently used dropped


@dataclass(frozen=True)
class PrefixMatch:
    """Result of matching a request against the cache."""

    num_cached_tokens: int
    stopped_at_in_flight: bool  # the match stopped at a block being computed in this step
    joins_pull: bool = False  # the next blocks are being pulled for another request: wait


class TieringHooks(Protocol):
    """The lower tiers, as the KV manager sees them (`tiering.kv_tiering.KVTiering`)."""

    def extend_match(
        self, request: Request, hashes: Sequence[BlockHash], num_device_blocks: int, max_blocks: int
    ) -> int:
        """After a device match of `num_device_blocks`, bring following blocks (up to
        `max_blocks` in all) from lower tiers; returns the tokens added or planned."""
        ...

    def num_computable(self, request: Request, num_left: int) -> int:
        """Tokens the request may compute before a planned fetch lands (at most `num_left`)."""
        ...

    def on_computed(self, request: Request) -> None:
        """The request's computed tokens advanced: land a planned fetch that is due."""
        ...

    def release(self, request: Request) -> None:
        """The request gives its blocks back: drop its planned fetch."""
        ...

    def land_ready(self, request: Request) -> None:
        """Land the request's planned fetch if it is due and has arrived (not waiting)."""
        ...

    def num_joined_blocks(
        self, request: Request, hashes: Sequence[BlockHash], num_device_blocks: int
    ) -> int:
        """Blocks after the device prefix that pulls in flight for other requests bring."""
        ...

    def awaits_load(self, request: Request) -> bool:
        """True while the request can compute nothing before its planned fetch lands."""
        ...

    def num_planned_tokens(self, request: Request) -> int:
        """Prompt tokens the request's planned fetch is to bring (0 without one)."""
        ...


class KVCacheManager:
    """Gives each request the blocks its tokens need, reuses cached prefixes, takes blocks back.

    `in_batch` says what a request does with prefix blocks registered earlier in the *same* step
    (their KV is being computed by another request of the batch): "share" them (in-batch dedup),
    "defer" the request to a later step when they are cached (batch split + cache), or "ignore"
    them and compute its own copy (naive).
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        model_fingerprint: str = "",
        enable_prefix_caching: bool = True,
        in_batch: str = "share",
    ) -> None:
        if in_batch not in IN_BATCH_MODES:
            raise ValueError(f"in_batch must be one of {IN_BATCH_MODES}, got {in_batch!r}")
        self.pool = pool
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.enable_prefix_caching = enable_prefix_caching
        self.in_batch = in_batch
        self._roots: OrderedDict[str, BlockHash] = OrderedDict()
        self._in_flight: set[BlockId] = set()  # registered by this step: KV not written yet
        self.tiering: TieringHooks | None = None  # lower tiers (DRAM, NVMe, Redis), when on

    def begin_step(self) -> None:
        """Blocks registered from now on belong to the new step's batch."""
        self._in_flight.clear()

    def abort_step(self) -> int:
        """The step's compute failed: forget the hashes registered since `begin_step` (their KV
        was never written) before anything can match or demote them. The blocks stay with their
        requests; emits BlockRemoved. Returns how many hashes were dropped."""
        dropped = self.pool.unregister(sorted(self._in_flight))
        self._in_flight.clear()
        return dropped

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """The hashes of the request's full blocks, extended as the request grows."""
        hashes = request.block_hashes
        if len(hashes) < request.num_tokens // self.block_size:
            parent = hashes[-1] if hashes else None
            hashes.extend(
                hash_blocks(
                    request.all_token_ids,
                    self.block_size,
                    self._root(request.cache_salt),
                    start_block=len(hashes),
                    parent=parent,
                )
            )
        return hashes

    def num_cached_prefix_tokens(self, request: Request) -> int:
        """How many leading tokens of a request not yet scheduled the device pool holds now.
        Read-only (no reference taken, nothing touched): an estimate for the load report."""
        if not self.enable_prefix_caching or request.block_ids or request.cache.skip_read:
            return 0
        num_hits = 0
        for block_hash in self.block_hashes(request):
            if not self.pool.contains(block_hash):
                break
            num_hits += 1
        return min(num_hits * self.block_size, request.num_tokens - 1)

    def num_free_tokens(self, request: Request) -> int:
        """Leading prompt tokens that are not work for the load report: a waiting request's
        device hits and what pulls in flight for others bring after them (it joins those), a
        running request's planned fetch (tiers, a peer)."""
        if request.block_ids:
            return 0 if self.tiering is None else self.tiering.num_planned_tokens(request)
        cached = self.num_cached_prefix_tokens(request)
        if self.tiering is None or request.peer is None or request.cache.skip_read:
            return cached
        hashes = self.block_hashes(request)
        joined = self.tiering.num_joined_blocks(request, hashes, cached // self.block_size)
        return min(cached + joined * self.block_size, request.num_tokens - 1)

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Reuse the longest cached prefix of a request that holds no blocks yet.

        Takes a reference on each hit block and sets the request's computed tokens. At least one
        token is always left to compute, since its logits are needed to sample.
        """
        assert not request.block_ids and request.num_computed_tokens == 0
        if not self.enable_prefix_caching or request.cache.skip_read:
            return PrefixMatch(0, False)
        tokens = request.all_token_ids
        hits: list[BlockId] = []
        stopped = False
        for i, block_hash in enumerate(self.block_hashes(request)):
            if (i + 1) * self.block_size >= len(tokens):
                break  # keep the last token (and so its block) to compute
            block_id = self.pool.lookup(
                block_hash, tokens[i * self.block_size : (i + 1) * self.block_size]
            )
            if block_id is None:
                break
            if block_id in self._in_flight and self.in_batch != "share":
                stopped = True
                break
            hits.append(block_id)
        self.pool.touch(hits)
        request.block_ids = hits
        request.num_computed_tokens = len(hits) * self.block_size
        num_device = len(hits)
        extra = 0
        if self.tiering is not None and not stopped:
            max_blocks = (len(tokens) - 1) // self.block_size
            hashes = self.block_hashes(request)
            if self.tiering.num_joined_blocks(request, hashes, num_device):
                return PrefixMatch(num_device * self.block_size, False, joins_pull=True)
            extra = self.tiering.extend_match(request, hashes, num_device, max_blocks)
        return PrefixMatch(num_device * self.block_size + extra, stopped)

    def num_computable(self, request: Request) -> int:
        """Tokens the request may compute now: all it has left, unless a fetch lands midway."""
        left = request.num_tokens - request.num_computed_tokens
        return left if self.tiering is None else self.tiering.num_computable(request, left)

    def on_computed(self, request: Request) -> None:
        """Called after the request's computed tokens advanced."""
        if self.tiering is not None:
            self.tiering.on_computed(request)

    def land_ready(self, request: Request) -> None:
        """Called before scheduling a running request: a fetch that arrived lands now."""
        if self.tiering is not None:
            self.tiering.land_ready(request)

    def awaits_load(self, request: Request) -> bool:
        """True while the request waits for a planned fetch with nothing to compute first
        (a pull from a peer): it is admitted all the same, to hold its blocks meanwhile."""
        return self.tiering is not None and self.tiering.awaits_load(request)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow `request.block_ids` to hold `num_new_tokens` more tokens, and register the
        blocks those tokens complete.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        total = request.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(request.block_ids)
        if need > 0:  # most decode steps need no block: the pool is not asked
            if need > self.pool.num_free:
                return False
            request.block_ids.extend(self.pool.allocate(need, request.cache.tenant))
        first, end = request.num_computed_tokens // self.block_size, total // self.block_size
        if self.enable_prefix_caching and first < end and not request.cache.skip_write:
            self._register(request, first, end)  # a block fills up: register it
        return True

    def fork(self, parent: Request, child: Request) -> list[tuple[BlockId, BlockId]] | None:
        """Give `child` the parent's KV: full blocks shared, the partial last block copied.

        Sets the child's block table and computed tokens to the parent's. Returns the
        (src, dst) block copies the caller must perform before the child's next step, or None,
        changing nothing, when no block is free for the copy.
        """
        num_full = parent.num_computed_tokens // self.block_size
        partial = num_full < len(parent.block_ids)
        if partial and self.pool.num_free == 0:
            return None
        shared = parent.block_ids[:num_full]
        self.pool.touch(shared)
        child.block_ids = list(shared)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens
        if not partial:
            return []
        [copy] = self.pool.allocate(1)
        child.block_ids.append(copy)
        return [(parent.block_ids[num_full], copy)]

    def free(self, request: Request) -> None:
        """Release all of a request's blocks, tail first so the prefix head is evicted last; a
        hand-off's (its prompt computed and kept by the prefill worker), before any other."""
        if self.tiering is not None:
            self.tiering.release(request)
        if request.cache.retention_s > 0:
            self._retain(request)
        copy = request.peer is not None and request.peer.handoff
        self.pool.free(list(reversed(request.block_ids)), evict_first=copy)
        request.block_ids = []

    def _register(self, request: Request, first: int, end: int) -> None:
        if first >= end:
            return
        hashes = self.block_hashes(request)
        tokens = request.all_token_ids
        for i in range(first, end):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            parent = hashes[i - 1] if i > 0 else None
            block_id = request.block_ids[i]
            if self.pool.register(block_id, hashes[i], chunk, parent, request.cache.tenant):
                self._in_flight.add(block_id)
                self._count_write(request, i)

    def _retain(self, request: Request) -> None:
        """Retain the request's full prompt blocks within its retention span (hit, computed or
        landed alike), as it gives them back: blocks in use are never victims, so retaining them
        now keeps them exactly as long. Counts what was retained and what the tenant's budget
        trimmed (the latest giving back counts: a preempted request retains again at its end)."""
        cache = request.cache
        span = request.num_prompt_tokens
        if cache.retention_tokens is not None:
            span = min(span, cache.retention_tokens)
        num_blocks = min(span // self.block_size, request.num_computed_tokens // self.block_size)
        ids = request.block_ids[:num_blocks]
        retention = Retention.for_seconds(
            cache.retention_s, time.time(), cache.tenant, cache.session_id
        )
        if not ids or retention is None:
            return
        trimmed = self.pool.retain(ids, retention)
        request.num_retained_tokens = (len(ids) - trimmed) * self.block_size
        request.num_retention_trimmed_tokens = trimmed * self.block_size

    def _count_write(self, request: Request, index: int) -> None:
        """Count block `index`, just registered by `request` under a hash the pool did not
        hold, as the request's cache write when it is a full block of its prompt. Only before a
        preemption: the report's cached tokens are the first admission's, and what a recompute
        registers again was counted (or cached) then, so cached + written never exceed the
        prompt."""
        if request.num_preemptions == 0 and index < request.num_prompt_tokens // self.block_size:
            request.num_cache_write_tokens += self.block_size

    def _root(self, salt: str | None) -> BlockHash:
        # A cache of a pure function: one entry per salt seen, so it is bounded (salts come
        # from clients and tenants, without limit).
        key = salt or ""
        root = self._roots.get(key)
        if root is None:
            root = self._roots[key] = root_hash(self.model_fingerprint, self.block_size, key)
            if len(self._roots) > MAX_ROOTS:
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(key)
        return root
