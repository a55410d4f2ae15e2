"""RedisPrefixIndex against a real redis-server: the MemoryPrefixIndex semantics (checked side by
side under random event streams), shared state between two index objects, stale snapshots, and
a Redis outage answered as a miss."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared, Event
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.index import IndexSnapshot, MemoryPrefixIndex, PrefixMatch, PurgeEpochUnknown
from cachesvc.kv.index_redis import RedisPrefixIndex
from cachesvc.kv.types import BlockHash, WorkerId

A, B = WorkerId("a"), WorkerId("b")
H = hash_blocks(list(range(40)), 4, root_hash("fp", 4))  # ten chained hashes
_namespaces = itertools.count()
MakeIndex = Callable[..., RedisPrefixIndex]


@pytest.fixture
def make_index(redis_url: str) -> MakeIndex:
    """`make_index()` opens a fresh namespace; `make_index(ns)` another client on one."""
    namespace = f"test-{uuid.uuid4().hex[:8]}"

    def make(ns: str = namespace) -> RedisPrefixIndex:
        return RedisPrefixIndex.from_url(redis_url, namespace=ns)

    return make


def _stored(seq: int, hashes: list[BlockHash], tier: str = "hbm") -> BlockStored:
    return BlockStored(seq, tier, tuple(hashes))


def test_lookup_apply_resync_and_drop(make_index: MakeIndex) -> None:
    index = make_index()
    for w in (A, B):
        index.resync(w, IndexSnapshot("inc", 0, {}))
    assert index.apply(A, "inc", [_stored(0, H[:5])])
    assert index.apply(B, "inc", [_stored(0, H[:2]), _stored(1, H[3:6])])
    assert index.longest_prefix(H) == {
        A: PrefixMatch(A, 5, {"hbm": 5}),
        B: PrefixMatch(B, 2, {"hbm": 2}),
    }
    assert index.longest_prefix([]) == {}
    assert index.apply(A, "inc", [_stored(0, H[:1])])  # a repeat is skipped
    assert not index.apply(A, "inc", [_stored(2, H[6:7])])  # seq 1 is missing
    assert index.next_seq(A) == 1
    assert not index.apply(A, "restarted", [])
    assert index.workers() == [A, B]
    index.drop_worker(A)
    assert set(index.longest_prefix(H)) == {B}
    assert index.next_seq(A) is None and index.num_blocks(A) == 0
    assert index.num_blocks(B) == 5
    index.check_integrity()


def test_two_routers_share_one_view(make_index: MakeIndex) -> None:
    first = make_index()
    second = make_index(first._prefix.split(":")[0])
    first.resync(A, IndexSnapshot("inc", 3, {"hbm": H[:2], "dram": H[2:4]}))
    assert second.next_seq(A) == 3
    # Both routers poll the worker and apply the same events: the second apply is a no-op.
    events: list[Event] = [_stored(3, H[4:5]), BlockMoved(4, tuple(H[:1]), "hbm", "nvme")]
    assert first.apply(A, "inc", events)
    assert second.apply(A, "inc", events)
    expected = {A: PrefixMatch(A, 5, {"nvme": 1, "hbm": 2, "dram": 2})}
    assert first.longest_prefix(H) == second.longest_prefix(H) == expected
    # A snapshot older than what the index follows is ignored; a new life replaces it.
    second.resync(A, IndexSnapshot("inc", 2, {"hbm": H[:1]}))
    assert first.longest_prefix(H)[A].num_blocks == 5
    second.resync(A, IndexSnapshot("restarted", 0, {"hbm": H[:1]}))
    assert first.longest_prefix(H) == {A: PrefixMatch(A, 1, {"hbm": 1})}
    first.check_integrity()


def test_redis_down_is_a_miss_not_an_error() -> None:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(port=1, decode_responses=True, retry=Retry(NoBackoff(), 0))
    index = RedisPrefixIndex(client, namespace="down")
    assert index.longest_prefix(H) == {}
    assert index.apply(A, "inc", [_stored(0, H[:1])])  # dropped: fetched again later
    index.resync(A, IndexSnapshot("inc", 0, {}))
    assert index.next_seq(A) is None and index.num_blocks(A) == 0
    # Three failures open the breaker: the later calls are not made at all.
    assert index.num_errors == 3 and index.num_skipped == 2
    with pytest.raises(ConnectionError, match="not reachable"):
        RedisPrefixIndex.from_url("redis://127.0.0.1:1/0")


# ---- random streams: Redis and memory indexes answer alike ---------------------------------------

TIERS = ("hbm", "dram", "nvme", "redis")
_event = st.tuples(
    st.sampled_from([A, B]),
    st.sampled_from(["store", "remove", "move", "clear", "resync", "drop"]),
    st.sampled_from(TIERS),
    st.sampled_from(TIERS),
    st.lists(st.integers(0, 9), min_size=1, max_size=4),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(_event, max_size=25))
def test_random_streams_match_memory_index(make_index: MakeIndex, ops: list[Any]) -> None:
    redis_index = make_index(f"prop-{next(_namespaces)}-{uuid.uuid4().hex[:6]}")
    memory = MemoryPrefixIndex()
    seqs = {A: 0, B: 0}
    for index in (redis_index, memory):
        for w in (A, B):
            index.resync(w, IndexSnapshot("inc", 0, {}))
    for worker, kind, tier, dst, picks in ops:
        hashes = tuple(H[i] for i in picks)
        if kind == "resync":
            seqs[worker] += 5
            snap = IndexSnapshot("inc", seqs[worker], {tier: hashes})
            redis_index.resync(worker, snap)
            memory.resync(worker, snap)
            continue
        if kind == "drop":
            redis_index.drop_worker(worker)
            memory.drop_worker(worker)
            seqs[worker] = 0
            for index in (redis_index, memory):
                index.resync(worker, IndexSnapshot("inc", 0, {}))
            continue
        seq = seqs[worker]
        seqs[worker] += 1
        event: Event
        if kind == "store":
            event = BlockStored(seq, tier, hashes)
        elif kind == "remove":
            event = BlockRemoved(seq, tier, hashes)
        elif kind == "move":
            event = BlockMoved(seq, hashes, tier, dst)
        else:
            event = Cleared(seq, tier)
        assert redis_index.apply(worker, "inc", [event]) == memory.apply(worker, "inc", [event])
    for start in range(3):
        assert redis_index.longest_prefix(H[start:]) == memory.longest_prefix(H[start:])
    for w in (A, B):
        assert redis_index.num_blocks(w) == memory.num_blocks(w)
        assert redis_index.next_seq(w) == memory.next_seq(w)
    redis_index.check_integrity()


def test_a_frozen_redis_costs_a_few_short_timeouts_then_none(own_redis: Any) -> None:
    """Redis frozen (SIGSTOP): the request path's read in flight times out after
    LOOKUP_TIMEOUT_S as a miss, and the later ones miss at once (the purge epoch unknown) while
    its connection is reopened off the request path; three failures open the breaker and the
    attempts stop; thawed, a probe after the cool-down finds it again."""
    import os
    import signal

    from cachesvc.kv.breaker import OPEN, CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(3, 5.0, clock=lambda: now[0])
    index = RedisPrefixIndex.from_url(own_redis.url, namespace="frozen")
    index._breaker = breaker
    index.resync(A, IndexSnapshot("inc", 0, {}))
    assert index.apply(A, "inc", [_stored(0, H[:3])])
    index.advance_purge_epoch()
    assert index.longest_prefix(H)[A].num_blocks == 3 and index.purge_epoch() == 1
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        assert index.longest_prefix(H) == {}  # times out: its connection is closed
        with pytest.raises(PurgeEpochUnknown):
            index.purge_epoch()  # not reconnected yet: skipped
        assert not index.connect_lookups() and not index.connect_lookups()
        assert breaker.state == OPEN and index.num_errors == 1
        for _ in range(10):
            assert index.longest_prefix(H) == {}
            with pytest.raises(PurgeEpochUnknown):
                index.purge_epoch()
        assert index.num_errors == 1 and index.num_skipped == 21
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    now[0] += 5.0  # the cool-down passed: one probe, which finds Redis again
    assert index.connect_lookups()
    assert index.longest_prefix(H)[A].num_blocks == 3
    assert index.purge_epoch() == 1


def test_a_probe_that_fails_otherwise_still_settles_the_breaker(own_redis: Any) -> None:
    """The half-open breaker's one probe raises something other than a Redis error (here a
    member that is not UTF-8, which the decoding client cannot read): that counts as a failed
    probe, so a later probe goes through, rather than the breaker waiting for good."""
    import os
    import signal

    import redis

    from cachesvc.kv.breaker import CLOSED, OPEN, CircuitBreaker

    now = [0.0]
    breaker = CircuitBreaker(3, 5.0, clock=lambda: now[0])
    index = RedisPrefixIndex.from_url(own_redis.url, namespace="probe")
    index._breaker = breaker
    index.resync(A, IndexSnapshot("inc", 0, {}))
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        assert index.longest_prefix(H) == {}
        assert not index.connect_lookups() and not index.connect_lookups()
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
    assert breaker.state == OPEN
    raw = redis.Redis.from_url(own_redis.url)
    raw.sadd("probe:{index}:workers", b"\xff")
    now[0] += 5.0
    with pytest.raises(UnicodeDecodeError):
        index.workers()  # the probe
    assert breaker.state == OPEN
    raw.srem("probe:{index}:workers", b"\xff")
    now[0] += 5.0
    assert index.workers() == [A]
    assert breaker.state == CLOSED
