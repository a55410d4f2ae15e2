"""Redis tier against a real redis-server: batched round trips, model namespaces, TTL; writes
queued off the caller's thread; a Redis that is down or frozen answered as misses (counted)
without raising, and skipped by the circuit breaker once it failed enough times in a row."""

from __future__ import annotations

import os
import signal
import socket
import uuid

import redis

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from cachesvc.kv.tiers.base import TierItem
from cachesvc.kv.tiers.redis_tier import RedisTier
from cachesvc.kv.types import BlockHash


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
    tier.flush()
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.ttl(tier.key(h(0))) <= 60
    assert tier.key(h(0)).startswith(f"cachesvc:kv:{ns}:".encode())
    assert tier.stats.stored == 100 and tier.gauges()["queue_depth"] == 0
    tier.remove([h(3)])
    tier.flush()
    assert tier.get([h(3)]) == [None] and client.get(tier.key(h(3))) is None
    tier.put([item(200)])
    tier.close()  # sends what is queued
    assert client.get(tier.key(h(200))) == item(200).data
    other_model.close()


def test_redis_down_is_a_counted_miss_then_a_quiet_one() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    tier = RedisTier(f"redis://127.0.0.1:{port}/0", namespace="x", retry_s=60, max_failures=2)
    assert tier.contains_prefix([h(0)]) == 0
    assert tier.breaker.state == CLOSED and tier.stats.errors == 1
    assert tier.get([h(0), h(1)]) == [None, None]  # one pipelined call: the second failure
    assert tier.breaker.state == OPEN and tier.stats.breaker_opens == 1 and tier.is_down
    assert tier.put([item(0)]) == [] and tier.stats.rejected == 1  # refused, not queued
    assert tier.get([h(0)]) == [None] and tier.contains_prefix([h(0)]) == 0
    assert tier.stats.errors == 2 and tier.stats.misses == 3  # open: no call, no new error
    assert tier.gauges()["breaker_open"] == 1.0
    tier.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_frozen_redis_costs_writes_nothing_and_reads_a_few_short_timeouts(
    own_redis: LocalRedis,
) -> None:
    blob = len(item(0).data)
    tier = RedisTier(own_redis.url, namespace="x", timeout_s=0.3, read_timeout_s=0.05)
    clock = Clock()
    tier.breaker = CircuitBreaker(max_failures=2, cooldown_s=60.0, clock=clock)
    tier.queue_bytes = 3 * blob
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)

    # Writes are queued, not sent on this thread; past the queue's budget they are dropped.
    assert tier.put([item(i) for i in range(5)]) == [h(0), h(1), h(2)]
    assert tier.stats.writes_dropped == 2 and tier.gauges()["queue_depth"] == 3
    # A queued block is held already: answered from memory, without asking Redis.
    assert tier.contains_prefix([h(0), h(1), h(2)]) == 3
    assert tier.get([h(1)]) == [item(1).data]
    assert tier.stats.errors == 0
    tier.flush()  # the writer's batch times out: one failure, the blocks reported lost
    assert tier.drain_lost() == [h(0), h(1), h(2)] and tier.stats.errors == 1
    assert tier.breaker.state == CLOSED and tier.gauges()["queue_depth"] == 0

    # A read times out too: the second failure in a row opens the breaker ...
    assert tier.get([h(0)]) == [None]
    assert tier.breaker.state == OPEN and tier.stats.breaker_opens == 1
    # ... and from then on neither reads nor writes touch the network.
    assert tier.put([item(7)]) == []
    for _ in range(10):
        assert tier.contains_prefix([h(0)]) == 0 and tier.get([h(0)]) == [None]
    assert tier.stats.errors == 2

    # After the cool-down one call probes Redis, answering again: the breaker closes.
    os.kill(own_redis.proc.pid, signal.SIGCONT)
    redis.Redis.from_url(own_redis.url).set(tier.key(h(9)), b"back")
    clock.now += 60.0
    assert tier.breaker.state == HALF_OPEN
    assert tier.get([h(9)]) == [b"back"]
    assert tier.breaker.state == CLOSED and tier.stats.errors == 2
    tier.close()
