"""A decode worker pulling a handed-off prompt's KV while its prefill still runs.

The router tells the decode worker which prefill worker computes a prompt as soon as it sends
that worker the prompt (`WorkerActor.prefetch`). The decode worker then asks the holder for the
prompt's blocks in chunks, all at once; each call waits at the holder until its blocks are
computed (`ChunkExporter.export(follow=True)`: the holder pins them at the boundary of the step
that computed them). Each chunk that arrives is checked as any pull's and landed in the pool
between two steps as cached blocks, as if a request of this worker had computed them. When the
request itself arrives (after its first token) its prefix is found in the pool, and only what
did not land in time is pulled then, as before.

So a prompt prefilled in chunks moves while the next chunk computes, and the copy into the pool
is spread over the prefill in chunk-sized pieces instead of landing in one step when the request
arrives. A prefetch never takes the last `RESERVE_SHARE` of the pool's free blocks from the
requests decoding here: it stops, and the request pulls the rest itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from cachesvc.kv.codec import KVBlock
from cachesvc.kv.types import BlockHash
from workers.engine.kv_copy import write_registered
from workers.engine.tiering.peer import PULL_CHUNK_BLOCKS, PeerPuller
from workers.peer.stage import prompt_hashes
from workers.transfer.threads import transfer_executor

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine import Engine

RESERVE_SHARE = 0.25  # of the pool: free blocks a prefetch leaves to the running requests
# How long the request that follows a prefetch waits for it without a chunk landing: the
# prompt is all computed by then (its first token is out), so a holder this slow is frozen or
# gone, and the request's own pull (or recompute) takes over.
STALL_S = 2.0
_NO_ROOM = -1
_KEPT = 64  # prefetches done whose requests have not come, kept
_Key = tuple[str | None, int, bytes]  # a prompt's: its salt, its length, a digest of its ids


@dataclass(frozen=True)
class PrefetchResult:
    """What one prefetch did: blocks landed in the pool, blocks that were there already, and
    whether it stopped early (the holder failed or was too slow, or no room here)."""

    landed_blocks: int
    present_blocks: int
    stopped: str | None = None


@dataclass
class _Prefetch:
    """A prefetch under way or done, until the request that follows it asks (`settled`)."""

    stop: threading.Event = field(default_factory=threading.Event)
    landed: int = 0  # blocks landed so far (its thread writes, the loop reads)
    at_s: float = field(default_factory=time.monotonic)  # when it last made progress
    future: asyncio.Future[PrefetchResult] | None = None  # its thread's, once started

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()


class Prefetcher:
    """The prefetches of one worker. Create and call it on the actor's event loop."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        # A few at once: one stuck on a frozen holder holds its thread until its deadline.
        self._threads = transfer_executor(4, "kv-prefetch")
        # Each prompt's last prefetch, until the request that follows it asks (`settled`);
        # at most `_KEPT` of them done.
        self._prefetches: OrderedDict[_Key, _Prefetch] = OrderedDict()
        self.num_prefetches = 0
        self.num_landed_blocks = 0
        self.num_stopped = 0

    async def prefetch(
        self,
        holder: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        num_blocks: int,
        timeout_s: float,
    ) -> PrefetchResult:
        """Pull the first `num_blocks` full blocks of the prompt from `holder` as it computes
        them (all by `timeout_s` from now: its prefill included) and land them in the pool.
        Cancelled, it stops after the chunk in hand."""
        peers = self._peers()
        if peers is None or num_blocks <= 0:
            return PrefetchResult(0, 0, "no peer pulls on this worker")
        key = _key(token_ids, num_blocks, self.engine.engine.config.block_size, cache_salt)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        entry = _Prefetch()
        ids = list(token_ids)
        pull = partial(self._pull, entry, holder, ids, cache_salt, num_blocks, deadline, loop)
        future = entry.future = loop.run_in_executor(self._threads, pull)
        self._prefetches.pop(key, None)
        self._prefetches[key] = entry
        self._trim()
        self.num_prefetches += 1
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            entry.stop.set()
            raise

    async def settled(
        self, token_ids: Sequence[int], cache_salt: str | None, num_blocks: int, timeout_s: float
    ) -> int:
        """Wait for a prefetch of this prompt still running (at most `timeout_s`, and no more
        than `STALL_S` of it without a chunk landing): its blocks are on their way, and a request
        pulling them itself would move them twice. Returns the tokens it landed (once: the
        request that follows it counts them as pulled)."""
        bs = self.engine.engine.config.block_size
        # Taken, not looked at: its blocks count for this request only.
        entry = self._prefetches.pop(_key(token_ids, num_blocks, bs, cache_salt), None)
        if entry is None:
            return 0
        began = time.monotonic()
        end = began + timeout_s
        while entry.future is not None and not entry.future.done():
            now = time.monotonic()
            # Quiet since this wait began or since its last chunk, whichever is later; what
            # it lands after this request gave up on it is not this request's pull.
            left = min(end - now, max(entry.at_s, began) + STALL_S - now)
            if left <= 0:
                break
            await asyncio.wait([entry.future], timeout=left)
        return entry.landed * bs

    def counters(self) -> dict[str, float]:
        return {
            "peer_prefetches": float(self.num_prefetches),
            "peer_prefetched_blocks": float(self.num_landed_blocks),
            "peer_prefetches_stopped": float(self.num_stopped),
        }

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _trim(self) -> None:
        """Forget the oldest prefetches done beyond `_KEPT` (their requests never came)."""
        done = [k for k, p in self._prefetches.items() if p.done]
        for key in done[: max(0, len(done) - _KEPT)]:
            del self._prefetches[key]

    def _peers(self) -> PeerPuller | None:
        tiering = self.engine.engine.tiering
        return None if tiering is None else tiering.peers

    def _pull(
        self,
        entry: _Prefetch,
        holder: str,
        token_ids: list[int],
        cache_salt: str | None,
        num_blocks: int,
        deadline: float,
        loop: asyncio.AbstractEventLoop,
    ) -> PrefetchResult:
        """On a prefetch thread: ask for every chunk at once (each answered once computed), land
        each as it comes, between steps. Blocking."""
        peers = self._peers()
        assert peers is not None
        engine = self.engine.engine
        hashes = prompt_hashes(engine, token_ids, cache_salt)[:num_blocks]
        first = asyncio.run_coroutine_threadsafe(
            self.engine.call(lambda e: _leading_present(e, token_ids, hashes)), loop
        ).result()
        chunks = [
            (lo, min(lo + PULL_CHUNK_BLOCKS, len(hashes)))
            for lo in range(first, len(hashes), PULL_CHUNK_BLOCKS)
        ]
        landed, present, stopped, stop = 0, first, None, entry.stop
        sent_chunks = peers.link.fetch(holder, token_ids, cache_salt, chunks, deadline, True, stop)
        try:
            for (lo, hi), sent in zip(chunks, sent_chunks, strict=False):
                blocks = peers.verify(sent, lo, hashes[lo:hi])
                got = len(blocks)
                land = partial(_land, token_ids=token_ids, hashes=hashes, blocks=blocks, first=lo)
                n = asyncio.run_coroutine_threadsafe(self.engine.call(land), loop).result()
                del sent, blocks, land  # a slot's view: its lease ends with the last reference
                if n == _NO_ROOM:
                    stopped = "no room in the pool"
                    break
                landed, present = landed + n, present + got - n
                entry.landed, entry.at_s = landed, time.monotonic()
                if got < hi - lo:
                    stopped = "a chunk came short"
                    break
                if stop.is_set():
                    stopped = "cancelled"
                    break
        except Exception as exc:  # the holder failed or was late: the request pulls or computes
            late = f"the holder did not answer ({type(exc).__name__})"
            stopped = "cancelled" if stop.is_set() else late
        finally:
            sent_chunks.close()  # what is still outstanding is cancelled at the holder
        self.num_landed_blocks += landed
        self.num_stopped += int(stopped is not None)
        return PrefetchResult(landed, present, stopped)


def _key(
    token_ids: Sequence[int], num_blocks: int, block_size: int, cache_salt: str | None
) -> _Key:
    ids = np.asarray(token_ids[: num_blocks * block_size], dtype=np.uint32)
    return (cache_salt, len(ids), xxhash.xxh3_128_digest(ids.tobytes()))


def _leading_present(engine: Engine, token_ids: Sequence[int], hashes: Sequence[BlockHash]) -> int:
    """How many leading blocks of the prompt the pool holds already (nothing to pull)."""
    bs = engine.config.block_size
    for i, h in enumerate(hashes):
        if engine.pool.lookup(h, token_ids[i * bs : (i + 1) * bs]) is None:
            return i
    return len(hashes)


def _land(
    engine: Engine,
    token_ids: Sequence[int],
    hashes: Sequence[BlockHash],
    blocks: Sequence[KVBlock],
    first: int,
) -> int:
    """Write `blocks` (blocks `first ..` of the prompt) into free blocks of the pool, register
    them under their hashes and leave them cached (no request holds them); blocks the pool
    holds already are skipped. Returns how many landed, or `_NO_ROOM`. Between steps."""
    pool, bs, tiering = engine.pool, engine.config.block_size, engine.tiering
    assert tiering is not None  # pulls come through it
    todo = [
        (first + i, b)
        for i, b in enumerate(blocks)
        if pool.lookup(b.block_hash, token_ids[(first + i) * bs : (first + i + 1) * bs]) is None
    ]
    if not todo:
        return 0
    if pool.num_free - len(todo) < RESERVE_SHARE * pool.num_blocks:
        return _NO_ROOM
    ids = pool.allocate(len(todo))
    indexes, landing = [i for i, _ in todo], [b for _, b in todo]
    kv_caches = engine.runner.kv_caches
    write_registered(kv_caches, pool, ids, landing, indexes, token_ids, hashes, bs, tiering.dtype)
    pool.free(ids[::-1])  # cached, tail first: the tail of a prefix is evicted before its head
    return len(todo)
