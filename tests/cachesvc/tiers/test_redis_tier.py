"""Redis tier against a real redis-server: batched round trips, model namespaces, TTL, and a
Redis that is down answered as misses (counted), quickly, without raising."""

from __future__ import annotations

import socket
import time
import uuid

import redis

from cachesvc.tiers.base import TierItem
from cachesvc.tiers.redis_tier import RedisTier
from cachesvc.types import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(16, "little"))


def item(i: int) -> TierItem:
    return TierItem(h(i), None, f"blob-{i}".encode() * 100)


def test_round_trip_prefix_and_namespaces(redis_url: str) -> None:
    ns = uuid.uuid4().hex
    tier = RedisTier(redis_url, namespace=ns, ttl_s=60)
    other_model = RedisTier(redis_url, namespace=uuid.uuid4().hex)
    assert tier.put([item(i) for i in range(100)]) == [h(i) for i in range(100)]
    hashes = [h(i) for i in range(100)] + [h(500), h(5)]
    assert tier.contains_prefix(hashes) == 100  # more than one pipeline batch
    got = tier.get([h(3), h(500), h(99)])
    assert got == [item(3).data, None, item(99).data]
    assert tier.stats.hits == 2 and tier.stats.misses == 1
    assert other_model.contains_prefix(hashes) == 0
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.ttl(tier.key(h(0))) <= 60
    assert tier.key(h(0)).startswith(f"cachesvc:kv:{ns}:".encode())
    tier.remove([h(3)])
    assert tier.get([h(3)]) == [None]
    tier.close()
    other_model.close()


def test_redis_down_is_a_counted_miss_then_a_quiet_one() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", namespace="x", timeout_s=0.2, retry_s=60)
    assert tier.put([item(0)]) == []
    start = time.perf_counter()
    assert tier.contains_prefix([h(0)]) == 0
    assert tier.get([h(0), h(1)]) == [None, None]
    assert time.perf_counter() - start < 0.1  # down: no new connection attempt per call
    assert tier.stats.errors == 1 and tier.stats.misses == 2 and tier.is_down
    tier.close()
