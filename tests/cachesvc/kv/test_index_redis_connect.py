"""The Redis prefix index behind a slow path: a connect and its handshake take longer than the
request path's 50 ms bound, yet the index connects its reads (off the request path, once) and
from then on reads the purge epoch and the cached blocks; a lost connection is reopened the
same way; the log says which."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from slow_link import SlowLink

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv import index_redis
from cachesvc.kv.events import BlockStored
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.index import IndexSnapshot, PurgeEpochUnknown
from cachesvc.kv.index_redis import LOOKUP_TIMEOUT_S, RedisPrefixIndex
from cachesvc.kv.types import WorkerId

A = WorkerId("a")
H = hash_blocks(list(range(16)), 4, root_hash("fp", 4))  # four chained hashes
HANDSHAKE_S = 0.2  # four times the lookup bound
assert HANDSHAKE_S > LOOKUP_TIMEOUT_S


def _first_epoch(index: RedisPrefixIndex, deadline_s: float = 20.0) -> int | None:
    """Read the purge epoch until it is known (None if it never is before the deadline)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            return index.purge_epoch()
        except PurgeEpochUnknown:
            time.sleep(0.05)
    return None


@pytest.fixture
def shared(own_redis: LocalRedis) -> tuple[LocalRedis, str]:
    """A namespace where worker A holds H[:3] in hbm and one purge has happened (written
    straight to Redis, not through the slow path)."""
    namespace = f"slow-{uuid.uuid4().hex[:8]}"
    direct = RedisPrefixIndex.from_url(own_redis.url, namespace)
    direct.resync(A, IndexSnapshot("inc", 0, {}))
    assert direct.apply(A, "inc", [BlockStored(0, "hbm", tuple(H[:3]))])
    assert direct.advance_purge_epoch() == 1
    return own_redis, namespace


def test_a_slow_handshake_is_paid_once_outside_the_reads(
    shared: tuple[LocalRedis, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    own_redis, namespace = shared
    caplog.set_level(logging.INFO)
    # Only the request path's reads are under test: the other calls may wait out the handshake.
    monkeypatch.setattr(index_redis, "UPDATE_TIMEOUT_S", 5.0)
    with SlowLink(own_redis.port, first_bytes_delay_s=HANDSHAKE_S) as link:
        slow = RedisPrefixIndex.from_url(link.url, namespace)
        assert _first_epoch(slow) == 1
        assert slow.longest_prefix(H)[A].num_blocks == 3
        unknown = slow.num_epoch_unknown
        for _ in range(10):  # connected: every read answers, none opens a connection
            assert slow.purge_epoch() == 1
            assert slow.longest_prefix(H)[A].num_blocks == 3
        assert slow.num_epoch_unknown == unknown and slow.num_errors == 0
        assert link.num_connections == 2  # the updates' and the reads'
        assert slow.lookups_up and "Redis prefix index lookups: connected" in caplog.text

        # The path stalls: the read in flight fails (its connection closed), and a read never
        # reopens it; once the path answers, the connection is reopened off the request path.
        link.freeze()
        with pytest.raises(PurgeEpochUnknown):
            slow.purge_epoch()
        assert not slow.lookups_up and "connection to Redis lost" in caplog.text
        link.thaw()
        assert _first_epoch(slow) == 1
        assert slow.longest_prefix(H)[A].num_blocks == 3
        assert slow.lookups_up and link.num_connections == 3
