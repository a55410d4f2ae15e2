"""The router's Redis Stream reader against a real redis-server: where it starts (after what the
index already holds, past a previous life of the worker), what it delivers (in order, grouped by
incarnation, skipping unreadable entries), and that a forgotten worker is no longer read."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import pytest

from cachesvc.kv.events import BlockStored, Event
from cachesvc.kv.events_redis import encode_event, stream_key
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.pool.events_source import (
    PolledEvents,
    RedisStreamEvents,
    StreamPosition,
    make_event_source,
)

H = hash_blocks(list(range(16)), 4, root_hash("fp", 4))
A, B = WorkerId("worker-0"), WorkerId("worker-1")
Delivered = list[tuple[WorkerId, str, list[int]]]


def _add(client: Any, namespace: str, worker: str, incarnation: str, seqs: range) -> None:
    for seq in seqs:
        event = BlockStored(seq, "hbm", (H[seq % len(H)],))
        client.xadd(stream_key(namespace, worker), encode_event(incarnation, event))


async def _follow(
    url: str, namespace: str, positions: dict[WorkerId, StreamPosition], then: Any, until: int
) -> tuple[RedisStreamEvents, Delivered]:
    """Start a reader, run `then()` (more writes), and collect until `until` events arrived."""
    delivered: Delivered = []

    async def apply(worker: WorkerId, incarnation: str, events: Sequence[Event]) -> None:
        delivered.append((worker, incarnation, [e.seq for e in events]))

    source = RedisStreamEvents.from_url(url, namespace)
    await source.start(positions, apply)
    await asyncio.to_thread(then)
    deadline = asyncio.get_running_loop().time() + 10
    while sum(len(s) for *_, s in delivered) < until:
        assert asyncio.get_running_loop().time() < deadline, delivered
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # nothing more should come
    await source.close()
    return source, delivered


@pytest.fixture
def client(redis_url: str) -> Any:
    import redis

    return redis.Redis.from_url(redis_url, decode_responses=True)


def test_starts_after_what_the_index_holds_and_past_an_old_life(
    redis_url: str, client: Any
) -> None:
    ns = f"src-{uuid.uuid4().hex[:8]}"
    _add(client, ns, A, "old", range(0, 5))
    _add(client, ns, A, "new", range(0, 7))
    positions = {A: StreamPosition("new", 4)}
    _, got = asyncio.run(
        _follow(redis_url, ns, positions, lambda: _add(client, ns, A, "new", range(7, 9)), 5)
    )
    assert [s for *_, seqs in got for s in seqs] == [4, 5, 6, 7, 8]
    assert {inc for _, inc, _ in got} == {"new"}


def test_a_fresh_life_is_read_from_its_first_entry(redis_url: str, client: Any) -> None:
    ns = f"src-{uuid.uuid4().hex[:8]}"
    _add(client, ns, A, "old", range(0, 3))
    positions = {A: StreamPosition("new", 0), B: StreamPosition("b", 0)}  # B: no stream yet

    def later() -> None:
        _add(client, ns, A, "new", range(0, 2))
        _add(client, ns, B, "b", range(0, 3))

    _, got = asyncio.run(_follow(redis_url, ns, positions, later, 5))
    assert sorted((w, s) for w, _, seqs in got for s in seqs) == [
        (A, 0),
        (A, 1),
        (B, 0),
        (B, 1),
        (B, 2),
    ]


def test_an_unreadable_entry_is_skipped_and_a_forgotten_worker_not_read(
    redis_url: str, client: Any
) -> None:
    ns = f"src-{uuid.uuid4().hex[:8]}"
    positions = {A: StreamPosition("a", 0), B: StreamPosition("b", 0)}

    async def run() -> Delivered:
        delivered: Delivered = []

        async def apply(worker: WorkerId, incarnation: str, events: Sequence[Event]) -> None:
            delivered.append((worker, incarnation, [e.seq for e in events]))

        source = RedisStreamEvents.from_url(redis_url, ns)
        await source.start(positions, apply)
        source.forget(B)
        _add(client, ns, B, "b", range(0, 2))
        _add(client, ns, A, "a", range(0, 1))
        client.xadd(stream_key(ns, A), {"v": "9", "inc": "a", "seq": "1"})
        _add(client, ns, A, "a", range(2, 3))
        for _ in range(500):
            if sum(len(s) for *_, s in delivered) >= 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        await source.close()
        return delivered

    got = asyncio.run(run())
    assert [(w, s) for w, _, seqs in got for s in seqs] == [(A, 0), (A, 2)]


def test_the_source_is_picked_by_config_and_follows_its_own_namespace(redis_url: str) -> None:
    assert isinstance(make_event_source(RouterConfig()), PolledEvents)
    assert not PolledEvents().follows(A, stream_key("cachesvc", A))
    source = make_event_source(RouterConfig(redis_url=redis_url, redis_namespace="ns"))
    assert isinstance(source, RedisStreamEvents)
    assert source.follows(A, stream_key("ns", A))
    assert not source.follows(A, stream_key("other", A))
    assert not source.follows(A, stream_key("ns", B))
    assert not source.follows(A, None)
    asyncio.run(source.close())
