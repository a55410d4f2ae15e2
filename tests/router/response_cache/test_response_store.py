"""The response cache in a real redis-server: shared by routers of one key, and a Redis that
is frozen (SIGSTOP), dead or forging entries is a miss, never an error or a stalled loop."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Iterator
from typing import TypeVar

import pytest

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.breaker import CLOSED, OPEN, CircuitBreaker
from cachesvc.kv.redis_client import async_redis_client
from router.response_cache.cache import CachedResponse, CachedSample, EntryShape, ResponseCache
from router.response_cache.entry import EntryCodec
from router.response_cache.store import RedisResponseStore, StoreStats
from workers.protocol import Usage

USAGE = Usage(3, 2, {"hbm": 2}, 1, 5.0, 100.0, "worker-0")
ANSWER = CachedResponse((CachedSample((5, 6), "hi", "length", USAGE),))
SHAPE = EntryShape(num_samples=1, vocab_size=100)
SECRET = b"s" * 32
KEY = b"k" * 16
T = TypeVar("T")


class Clock:
    """The breaker's clock, moved by the test: no sleeping for a cool-down."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _cache(
    url: str, namespace: str, secret: bytes = SECRET, breaker: CircuitBreaker | None = None
) -> ResponseCache:
    """A cache of a Redis store whose lookup connections are open (when Redis answers)."""
    stats = StoreStats()
    store = RedisResponseStore.from_url(
        url, namespace, 60, stats, breaker=breaker, connect_timeout_s=0.3
    )
    await store.connect()
    return ResponseCache(store, EntryCodec(secret), stats)


def _store(cache: ResponseCache) -> RedisResponseStore:
    assert isinstance(cache.store, RedisResponseStore)
    return cache.store


@pytest.fixture
def frozen_later(own_redis: LocalRedis) -> Iterator[LocalRedis]:
    """`own_redis`, thawed (SIGCONT) at the end even if the test failed while it was frozen."""
    yield own_redis
    if own_redis.proc is not None:
        os.kill(own_redis.proc.pid, signal.SIGCONT)


def test_routers_of_one_key_share_entries_and_other_keys_are_refused(redis_url: str) -> None:
    async def run() -> None:
        one, two = await _cache(redis_url, "rc-share"), await _cache(redis_url, "rc-share")
        stranger = await _cache(redis_url, "rc-share", secret=b"x" * 32)
        one.offer(KEY, ANSWER)
        await one.flush()
        assert await two.get(KEY, SHAPE) == ANSWER  # another router sees it
        assert await stranger.get(KEY, SHAPE) is None  # not signed with its key
        assert stranger.stats.rejected == 1 and stranger.stats.misses == 1
        assert await two.clear() == 1
        assert await one.get(KEY, SHAPE) is None
        for cache in (one, two, stranger):
            await cache.close()

    asyncio.run(run())


def test_entries_written_into_redis_by_others_are_counted_misses(redis_url: str) -> None:
    async def run() -> None:
        cache = await _cache(redis_url, "rc-forged")
        raw = async_redis_client(redis_url, 0.5)
        name = "rc-forged:response:"
        genuine = EntryCodec(SECRET).encode(KEY, ANSWER)
        other = b"o" * 16
        await raw.set(name + KEY.hex(), EntryCodec(b"f" * 32).encode(KEY, ANSWER))  # forged
        await raw.set(name + other.hex(), genuine)  # key A's entry under key B
        assert await cache.get(KEY, SHAPE) is None
        assert await cache.get(other, SHAPE) is None
        await raw.set(name + KEY.hex(), b"not an entry")  # malformed
        assert await cache.get(KEY, SHAPE) is None
        await raw.set(name + KEY.hex(), genuine)
        assert await cache.get(KEY, SHAPE) == ANSWER
        assert (cache.stats.rejected, cache.stats.misses, cache.stats.hits) == (3, 3, 1)
        await raw.aclose()
        await cache.close()

    asyncio.run(run())


async def _ticking_while(coro: Awaitable[T]) -> tuple[T, int]:
    """`await coro`, counting how often another task of the loop ran meanwhile."""
    ticks = 0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    ticker = asyncio.create_task(tick())
    try:
        return await coro, ticks
    finally:
        done.set()
        await ticker


def test_a_frozen_redis_is_a_miss_then_skipped_then_used_again(frozen_later: LocalRedis) -> None:
    assert frozen_later.proc is not None
    clock = Clock()
    breaker = CircuitBreaker(max_failures=3, cooldown_s=10.0, clock=clock)

    async def run() -> None:
        cache = await _cache(frozen_later.url, "rc", breaker=breaker)
        store = _store(cache)
        assert await cache.put(KEY, ANSWER)
        assert await cache.get(KEY, SHAPE) == ANSWER
        os.kill(frozen_later.proc.pid, signal.SIGSTOP)
        # A lookup times out as a miss; the loop keeps running other tasks meanwhile.
        found, ticks = await _ticking_while(cache.get(KEY, SHAPE))
        assert found is None and ticks > 0
        # Its connection is closed: the next lookup is a miss at once, reconnecting meanwhile
        # in the background, which fails too.
        assert await cache.get(KEY, SHAPE) is None and cache.stats.skipped == 1
        assert not await store.connect()
        assert breaker.state == CLOSED and cache.stats.errors == 2
        assert not await cache.put(KEY, ANSWER)  # the third failure in a row opens it
        assert breaker.state == OPEN and cache.stats.breaker_opens == 1
        assert cache.stats.errors == 3
        # Open: Redis is not called at all (no timeout to wait for).
        assert await cache.get(KEY, SHAPE) is None
        cache.offer(KEY, ANSWER)
        await cache.flush()
        assert cache.stats.skipped == 3 and cache.stats.errors == 3
        os.kill(frozen_later.proc.pid, signal.SIGCONT)
        clock.now += 11.0  # cooled down: the next call probes Redis, and it answers
        assert await cache.get(KEY, SHAPE) is None  # the probe is a reconnect
        assert await store.connect() and breaker.state == CLOSED
        assert await cache.get(KEY, SHAPE) == ANSWER
        await cache.close()

    asyncio.run(run())


def test_a_dead_redis_is_a_miss(own_redis: LocalRedis) -> None:
    async def run() -> None:
        cache = await _cache(own_redis.url, "rc")
        assert await cache.put(KEY, ANSWER)
        own_redis.stop(kill=True)
        assert await cache.get(KEY, SHAPE) is None
        assert not await cache.put(KEY, ANSWER)
        assert cache.stats.errors == 2 and cache.stats.misses == 1
        assert await cache.clear() == 0
        await cache.close()

    asyncio.run(run())


def test_puts_behind_a_stalled_write_overflow_the_queue(frozen_later: LocalRedis) -> None:
    assert frozen_later.proc is not None

    async def run() -> None:
        cache = await _cache(frozen_later.url, "rc")
        cache.queue_entries = 2
        os.kill(frozen_later.proc.pid, signal.SIGSTOP)
        cache.offer(b"0" * 16, ANSWER)
        await asyncio.sleep(0)  # the writer takes the first answer and waits on Redis
        for i in range(1, 5):
            cache.offer(bytes([i]) * 16, ANSWER)
        assert cache.stats.dropped == 2  # two wait behind the stalled write, two dropped
        os.kill(frozen_later.proc.pid, signal.SIGCONT)
        await cache.flush()
        assert cache.stats.stores + cache.stats.errors + cache.stats.skipped == 3
        await cache.close()

    asyncio.run(run())
