"""The response cache's Redis behind a slow path: a connect and its handshake take longer than a
lookup's 50 ms bound, yet the store connects (in the background, once) and answers lookups
from then on; `cachesvc_response_cache_redis_up` and the log say whether it is connected."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from slow_link import SlowLink

from cachesvc.bench.local_redis import LocalRedis
from router.metrics import RouterMetrics
from router.response_cache.cache import CachedResponse, CachedSample, EntryShape, ResponseCache
from router.response_cache.entry import EntryCodec
from router.response_cache.store import RedisResponseStore, StoreStats
from workers.protocol import Usage

USAGE = Usage(3, 2, {"hbm": 2}, 1, 5.0, 100.0, "worker-0")
ANSWER = CachedResponse((CachedSample((5, 6), "hi", "length", USAGE),))
SHAPE = EntryShape(num_samples=1, vocab_size=100)
KEY = b"k" * 16
HANDSHAKE_S = 0.2  # four times the lookup bound


async def _first_hit(cache: ResponseCache, deadline_s: float = 30.0) -> CachedResponse | None:
    """Look up KEY until it hits (None if it never does before the deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        found = await cache.get(KEY, SHAPE)
        if found is not None:
            return found
        await asyncio.sleep(0.05)
    return None


def test_a_slow_handshake_is_paid_once_outside_the_lookups(
    own_redis: LocalRedis, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="router.response_cache.store")
    metrics = RouterMetrics()

    def redis_up() -> float | None:
        return metrics.registry.get_sample_value("cachesvc_response_cache_redis_up")

    async def run() -> None:
        with SlowLink(own_redis.port, first_bytes_delay_s=HANDSHAKE_S) as link:
            stats = StoreStats()
            store = RedisResponseStore.from_url(link.url, "rc-slow", 60, stats, timeout_s=0.05)
            metrics.watch_response_cache(stats)
            cache = ResponseCache(store, EntryCodec(b"s" * 32), stats)
            assert await cache.put(KEY, ANSWER)  # a write may take its time connecting
            assert await _first_hit(cache) == ANSWER
            assert redis_up() == 1.0
            assert "connected to Redis" in caplog.text
            connections = link.num_connections
            for _ in range(20):  # later lookups reuse the connections: no new handshake
                assert await cache.get(KEY, SHAPE) == ANSWER
            assert link.num_connections == connections and stats.errors == 0

            own_redis.stop()
            assert await cache.get(KEY, SHAPE) is None
            assert redis_up() == 0.0
            assert not await store.connect()  # the reconnect in the background fails too
            assert redis_up() == 0.0 and stats.errors == 2
            await cache.close()

    asyncio.run(run())
