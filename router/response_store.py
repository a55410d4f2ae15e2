"""Where the response cache keeps its entries: an LRU in this router's memory, or Redis.

A store moves opaque blobs; the response cache signs and checks them (`router.response_entry`).
Neither store raises: a missing entry, an unreadable one and a failing Redis are all a miss.

The Redis store sits on the request path only for lookups, so it is built not to slow one down
when Redis does: its client never retries (one call costs at most one timeout), a lookup is
bounded by `timeout_s` (tens of milliseconds, on the event loop's own sockets, never blocking
it), and a circuit breaker shared by reads and writes skips Redis for a while after a few
failures in a row, then lets one call probe it. Writes happen after the stream's end, from the
response cache's write queue, with the longer `write_timeout_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from cachesvc.redis_client import async_redis_client
from cachesvc.tiers.breaker import HALF_OPEN, CircuitBreaker

_log = logging.getLogger(__name__)
T = TypeVar("T")


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
    skipped: int = 0  # store calls not made: the breaker had Redis marked down
    breaker_opens: int = 0


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
    ) -> None:
        """`reader` serves lookups and `writer` the rest: redis.asyncio clients whose socket
        timeouts bound each call (`cachesvc.redis_client`: no client retries); a whole lookup
        (a connect and the client's handshake included) is also bounded by `timeout_s`."""
        import redis

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError, TimeoutError)
        self._reader, self._writer = reader, writer
        self._prefix = f"{namespace}:response:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self.stats = stats
        self.breaker = breaker or CircuitBreaker(max_failures=3, cooldown_s=2.0)
        self.timeout_s = timeout_s
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
    ) -> RedisResponseStore:
        """A store of `url` whose lookups wait at most `timeout_s` and writes `write_timeout_s`
        (connects lazily: an unreachable Redis is a miss, not an error at start)."""
        reader = async_redis_client(url, timeout_s)
        writer = async_redis_client(url, write_timeout_s)
        return cls(reader, writer, namespace, ttl_s, stats, breaker, timeout_s)

    def _name(self, name: bytes) -> str:
        return self._prefix + name.hex()

    async def get(self, name: bytes) -> bytes | None:
        async def lookup() -> Any:
            async with asyncio.timeout(self.timeout_s):
                return await self._reader.get(self._name(name))

        blob = await self._call(lookup)
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
        for client in (self._reader, self._writer):
            try:
                await client.aclose()
            except self._errors as exc:
                _log.debug("closing the response cache's Redis client: %s", exc)

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T | None:
        """`await fn()` through the breaker; None when skipped or failed (counted). The client's
        socket timeouts bound the call (connect, handshake, each reply)."""
        if not self.breaker.allow():
            self.stats.skipped += 1
            return None
        try:
            out = await fn()
        except self._errors as exc:
            self._failed(exc)
            return None
        except BaseException:
            # Cancelled (the client went away): no verdict on Redis, but a cancelled probe
            # must not hold the breaker half-open for good.
            if self.breaker.state == HALF_OPEN:
                self.breaker.failed()
            raise
        self.breaker.succeeded()
        return out

    def _failed(self, exc: BaseException) -> None:
        self.stats.errors += 1
        if self.breaker.failed():
            self.stats.breaker_opens += 1
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # one line per outage
            self._last_warning = now
            _log.warning("response cache in Redis unavailable (a miss): %r", exc)
