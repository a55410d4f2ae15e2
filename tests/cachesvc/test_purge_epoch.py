"""The purge epoch kept by the prefix index: it only goes up, routers sharing one Redis index see
another's purge at once, a restarted router (a new index object) keeps it, and a Redis outage
makes a purge fail instead of leaving the routers on the old epoch."""

from __future__ import annotations

import uuid

import pytest

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.index import MemoryPrefixIndex
from cachesvc.index_redis import RedisPrefixIndex


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


def test_redis_outage_keeps_the_last_epoch_and_fails_a_purge(own_redis: LocalRedis) -> None:
    index = RedisPrefixIndex.from_url(own_redis.url, "outage")
    assert index.advance_purge_epoch() == 1
    own_redis.stop()
    assert index.purge_epoch() == 1  # not 0: that would reach the purged blocks again
    with pytest.raises(ConnectionError, match="cannot start a purge epoch"):
        index.advance_purge_epoch()
    assert index.num_errors == 2
