"""Where the response cache keeps its entries: an LRU in this router's memory, or Redis.

A store moves opaque blobs; the response cache signs and checks them
(`router.response_cache.entry`). Neither store raises: a missing entry, an unreadable one and a
failing Redis are all a miss.

The Redis store sits on the request path only for lookups, so it is built not to slow one down
when Redis does: its client never retries (one call costs at most one timeout), a lookup is
bounded by `timeout_s` (tens of milliseconds, on the event loop's own sockets, never blocking
it), and a circuit breaker shared by reads and writes skips Redis for a while after a few
failures in a row, then lets one call probe it. Writes happen after the stream's end, from the
response cache's write queue, with the longer `write_timeout_s`.

A lookup never connects: a connect and the client's handshake (TLS, AUTH) can take longer than
a lookup's bound, and would then never succeed. The lookups' connections are opened ahead, in
the background, with the longer `connect_timeout_s`: when the store is built on a running event
loop, and again whenever a lookup failed (the connection it used is closed). Until they are
open a lookup is a miss at once (`StoreStats.skipped`); `StoreStats.redis_up` says which, and
the transitions are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from cachesvc.kv.breaker import HALF_OPEN, CircuitBreaker
from cachesvc.kv.redis_client import async_redis_client

_log = logging.getLogger(__name__)
T = TypeVar("T")
CONNECT_TIMEOUT_S = 2.0  # a connect with its handshake, in the background
LOOKUP_CONNECTIONS = 8  # lookups at once; more are misses (each takes well under a millisecond)


@dataclass
class StoreStats:
    """The response cache's counters (exported by `router.metrics`)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    errors: int = 0  # store calls that failed (each a miss or a lost write)
    bytes: int = 0
    entries: int = 0
    rejected: int = 0  # entries read back that failed authentication or validation
    dropped: int = 0  # answers not stored: the write queue was full
    too_large: int = 0  # answers not stored: over the configured entry size
    skipped: int = 0  # store calls not made: Redis down (breaker open, not connected) or busy
    breaker_opens: int = 0
    redis_up: bool | None = None  # lookup connections open to Redis (None: not a Redis store)


class ResponseStore(Protocol):
    """Where entries live. `get` of a missing or unreadable entry is None; no method raises."""

    async def get(self, name: bytes) -> bytes | None: ...

    async def put(self, name: bytes, blob: bytes) -> bool:
        """Store `blob` under `name`; whether it was stored."""
        ...

    async def clear(self) -> int: ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """An LRU bounded in bytes (keys and values counted)."""

    def __init__(self, max_bytes: int, stats: StoreStats) -> None:
        self.max_bytes = max_bytes
        self.stats = stats
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()

    async def get(self, name: bytes) -> bytes | None:
        blob = self._entries.get(name)
        if blob is not None:
            self._entries.move_to_end(name)
        return blob

    async def put(self, name: bytes, blob: bytes) -> bool:
        size = len(name) + len(blob)
        if size > self.max_bytes:
            return False  # larger than the whole cache: not worth evicting everything for
        old = self._entries.pop(name, None)
        if old is not None:
            self.stats.bytes -= len(name) + len(old)
        while self._entries and self.stats.bytes + size > self.max_bytes:
            evicted_name, evicted = self._entries.popitem(last=False)
            self.stats.bytes -= len(evicted_name) + len(evicted)
            self.stats.evictions += 1
        self._entries[name] = blob
        self.stats.bytes += size
        self.stats.entries = len(self._entries)
        return True

    async def clear(self) -> int:
        dropped = len(self._entries)
        self._entries.clear()
        self.stats.bytes, self.stats.entries = 0, 0
        return dropped

    async def close(self) -> None:
        return None


class RedisResponseStore:
    """Entries in Redis under `<namespace>:response:<key hex>`, each with a TTL (Redis evicts
    by its own policy; this router counts no evictions). Any Redis error is a miss."""

    def __init__(
        self,
        reader: Any,
        writer: Any,
        namespace: str,
        ttl_s: float,
        stats: StoreStats,
        breaker: CircuitBreaker | None = None,
        timeout_s: float = 0.05,
        num_connections: int = LOOKUP_CONNECTIONS,
    ) -> None:
        """`reader` serves lookups and `writer` the rest: redis.asyncio clients that never
        retry (`cachesvc.kv.redis_client`). The reader's socket timeouts bound its connects (a
        handshake included), its pool holds `num_connections` (opened ahead, see `connect`),
        and each lookup is bounded by `timeout_s`; the writer's socket timeouts bound writes."""
        import redis

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError, TimeoutError)
        self._reader, self._writer = reader, writer
        self._prefix = f"{namespace}:response:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self.stats = stats
        self.stats.redis_up = False
        self.breaker = breaker or CircuitBreaker(max_failures=3, cooldown_s=2.0)
        self.timeout_s = timeout_s
        self.num_connections = num_connections
        self._num_lookups = 0  # under way, each holding one of the reader's connections
        self._connecting: asyncio.Task[bool] | None = None
        self._last_warning = 0.0

    @classmethod
    def from_url(
        cls,
        url: str,
        namespace: str,
        ttl_s: float,
        stats: StoreStats,
        timeout_s: float = 0.05,
        write_timeout_s: float = 0.5,
        breaker: CircuitBreaker | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> RedisResponseStore:
        """A store of `url` whose lookups wait at most `timeout_s`, writes `write_timeout_s`
        and connects `connect_timeout_s`. Never fails: built on a running event loop it starts
        connecting at once, else at its first lookup; an unreachable Redis is a miss."""
        reader = async_redis_client(url, connect_timeout_s, max_connections=LOOKUP_CONNECTIONS)
        writer = async_redis_client(url, write_timeout_s)
        store = cls(reader, writer, namespace, ttl_s, stats, breaker, timeout_s)
        with contextlib.suppress(RuntimeError):  # no running loop: the first lookup connects
            asyncio.get_running_loop()
            store._connect_in_background()
        return store

    def _name(self, name: bytes) -> str:
        return self._prefix + name.hex()

    async def connect(self) -> bool:
        """Open the lookups' connections now, or wait for the attempt under way (at most the
        reader's connect timeout); whether they are open. A miss, not an error, when Redis
        does not answer (counted, and the breaker told)."""
        task = self._connect_in_background()
        if task is not None:
            await asyncio.shield(task)  # a caller that gives up does not end the attempt
        return bool(self.stats.redis_up)

    async def get(self, name: bytes) -> bytes | None:
        if not self.stats.redis_up:
            self._connect_in_background()
            self.stats.skipped += 1
            return None
        if self._num_lookups >= self.num_connections:
            self.stats.skipped += 1  # every connection busy: a miss, no verdict on Redis
            return None

        async def lookup() -> Any:
            async with asyncio.timeout(self.timeout_s):
                return await self._reader.get(self._name(name))

        self._num_lookups += 1
        try:
            blob = await self._call(lookup, lookup=True)
        finally:
            self._num_lookups -= 1
        return None if blob is None else bytes(blob)

    async def put(self, name: bytes, blob: bytes) -> bool:
        def send() -> Awaitable[Any]:
            return self._writer.set(self._name(name), blob, px=self._ttl_ms)

        return bool(await self._call(send))

    async def clear(self) -> int:
        async def delete_all() -> int:
            dropped = 0
            async for found in self._writer.scan_iter(match=self._prefix + "*", count=500):
                dropped += int(await self._writer.delete(found))
            return dropped

        # Still skipped while the breaker has Redis down: Purge answers at once, not after a
        # timeout per command.
        return await self._call(delete_all) or 0

    async def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._connecting
        for client in (self._reader, self._writer):
            try:
                await client.aclose()
            except self._errors as exc:
                _log.debug("closing the response cache's Redis client: %s", exc)

    def _connect_in_background(self) -> asyncio.Task[bool] | None:
        """The attempt to open the lookups' connections under way, started when none is and
        the breaker allows one (it is then the breaker's call); None when it does not."""
        if self._connecting is None or self._connecting.done():
            if not self.breaker.allow():
                return None
            self._connecting = asyncio.get_running_loop().create_task(self._open_connections())
        return self._connecting

    async def _open_connections(self) -> bool:
        # As many PINGs at once as connections may be idle: each takes a connection of its own
        # from the reader's pool and opens it (or reopens one a failed lookup closed).
        num = max(1, self.num_connections - self._num_lookups)
        try:
            await asyncio.gather(*(self._reader.ping() for _ in range(num)))
        except self._errors as exc:
            self._failed(exc)
            return False
        except BaseException:
            self.breaker.failed()  # cancelled (closing): never leave a probe outstanding
            raise
        self.breaker.succeeded()
        self.stats.redis_up = True
        _log.info("response cache: connected to Redis (%d lookup connections)", num)
        return True

    async def _call(self, fn: Callable[[], Awaitable[T]], lookup: bool = False) -> T | None:
        """`await fn()` through the breaker; None when skipped or failed (counted). A failed
        or cancelled `lookup` leaves its connection closed: the lookups wait for new ones."""
        if not self.breaker.allow():
            self.stats.skipped += 1
            return None
        try:
            out = await fn()
        except self._errors as exc:
            self._failed(exc, lookup)
            return None
        except BaseException:
            # Cancelled (the client went away): no verdict on Redis, but a cancelled probe
            # must not hold the breaker half-open for good.
            if self.breaker.state == HALF_OPEN:
                self.breaker.failed()
            if lookup:
                self._lost()
            raise
        self.breaker.succeeded()
        return out

    def _failed(self, exc: BaseException, lookup: bool = True) -> None:
        self.stats.errors += 1
        if self.breaker.failed():
            self.stats.breaker_opens += 1
        if lookup:
            self._lost()
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # one line per outage
            self._last_warning = now
            _log.warning(
                "response cache in Redis unavailable (every lookup a miss until it answers): %r",
                exc,
            )

    def _lost(self) -> None:
        if self.stats.redis_up:
            _log.info("response cache: lookup connections to Redis lost; reconnecting")
        self.stats.redis_up = False
