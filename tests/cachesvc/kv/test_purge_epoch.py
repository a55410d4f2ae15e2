"""The purge epoch kept by the prefix index: it only goes up, routers sharing one Redis index see
another's purge at once, a restarted router (a new index object) keeps it, and a Redis outage
makes a purge fail instead of leaving the routers on the old epoch. A router that cannot read
the epoch (Redis down, frozen, or its breaker open) says so rather than answer the last epoch it
read, and its requests get salts that reach no block of any epoch."""

from __future__ import annotations

import uuid
from urllib.parse import urlparse

import pytest
from slow_link import SlowLink

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.breaker import OPEN, CircuitBreaker
from cachesvc.kv.hashing import epoch_salt, unshared_salt
from cachesvc.kv.index import MemoryPrefixIndex, PurgeEpochUnknown
from cachesvc.kv.index_redis import RedisPrefixIndex


def test_memory_index_counts_purges() -> None:
    index = MemoryPrefixIndex()
    assert index.purge_epoch() == 0
    assert index.advance_purge_epoch() == 1
    assert index.advance_purge_epoch() == 2
    assert index.purge_epoch() == 2


def test_routers_sharing_redis_agree_and_a_restart_keeps_it(redis_url: str) -> None:
    namespace = f"epoch-{uuid.uuid4().hex[:8]}"
    first = RedisPrefixIndex.from_url(redis_url, namespace)
    second = RedisPrefixIndex.from_url(redis_url, namespace)
    assert first.purge_epoch() == second.purge_epoch() == 0
    assert first.advance_purge_epoch() == 1
    assert second.purge_epoch() == 1  # the next request of the other router hashes anew
    assert second.advance_purge_epoch() == 2  # purges of two routers never share an epoch
    assert first.purge_epoch() == 2
    restarted = RedisPrefixIndex.from_url(redis_url, namespace)
    assert restarted.purge_epoch() == 2
    other = RedisPrefixIndex.from_url(redis_url, f"other-{uuid.uuid4().hex[:8]}")
    assert other.purge_epoch() == 0  # another deployment's purges are not this one's


def test_redis_outage_leaves_the_epoch_unknown_and_fails_a_purge(own_redis: LocalRedis) -> None:
    index = RedisPrefixIndex.from_url(own_redis.url, "outage")
    assert index.advance_purge_epoch() == 1
    own_redis.stop()
    # Not 1: another router may have purged epoch 1 meanwhile. Nor 0, which was purged.
    with pytest.raises(PurgeEpochUnknown, match="purge epoch unknown"):
        index.purge_epoch()
    with pytest.raises(ConnectionError, match="cannot start a purge epoch"):
        index.advance_purge_epoch()
    assert index.num_errors == 2 and index.num_epoch_unknown == 1


def test_a_purge_through_another_router_is_never_missed(redis_url: str) -> None:
    """The second router's link to Redis freezes; the first purges meanwhile. The second must
    not answer the epoch it read last, neither while its reads time out nor while its breaker
    skips them; once Redis answers again (a probe after the cool-down) it reads the new one."""
    namespace = f"missed-{uuid.uuid4().hex[:8]}"
    first = RedisPrefixIndex.from_url(redis_url, namespace)
    now = [0.0]
    with SlowLink(int(urlparse(redis_url).port or 0)) as link:
        second = RedisPrefixIndex.from_url(link.url, namespace)
        second._breaker = CircuitBreaker(3, 5.0, clock=lambda: now[0])
        assert second.purge_epoch() == 0
        link.freeze()
        assert first.advance_purge_epoch() == 1
        with pytest.raises(PurgeEpochUnknown):
            second.purge_epoch()  # times out: its connection is closed
        # Reopening it times out twice more (off the request path), opening the breaker.
        assert not second.connect_lookups() and not second.connect_lookups()
        assert second._breaker.state == OPEN
        for _ in range(3):
            with pytest.raises(PurgeEpochUnknown):
                second.purge_epoch()
        assert second.num_errors == 1 and second.num_skipped == 3
        assert second.num_epoch_unknown == 4
        link.thaw()
        with pytest.raises(PurgeEpochUnknown):
            second.purge_epoch()  # still within the cool-down
        now[0] += 5.0
        assert second.connect_lookups()
        assert second.purge_epoch() == 1


def test_unshared_salts_meet_no_epoch_and_no_other_request() -> None:
    salts = [None, "", "x", "tenant:acme", "tenant:acme/x"]
    shared = {epoch_salt(s, e) or "" for s in salts for e in range(3)}
    unshared = [unshared_salt(s) for s in salts for _ in range(3)]
    assert len(set(unshared)) == len(unshared)
    assert not shared & set(unshared)
