"""KV events through Redis Streams, end to end: workers publish every event to their stream, routers
that poll them only once an hour still see a request's blocks at once (only the stream can have
brought them), two routers sharing the index route alike, and a killed worker leaves the index."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from routing_support import GROUPS, PREFIX_LEN, assert_two_routers_route_alike, serve_ids

from cachesvc.kv.events_redis import EventStreamConfig, stream_key
from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.pool.events_source import RedisStreamEvents
from workers.config import EngineConfig

pytestmark = pytest.mark.system
NAMESPACE = f"streams-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker_pair(
    ray_cluster: None, engine_config: EngineConfig, redis_url: str
) -> Iterator[dict[WorkerId, Any]]:
    """Two workers publishing their events to this module's streams (the last test kills one)."""
    import ray

    from workers.spawn import spawn_worker

    stream = EventStreamConfig(redis_url, NAMESPACE)
    actors = {
        WorkerId(f"worker-{i}"): spawn_worker(
            f"worker-{i}", engine_config, num_cpus=0.5, max_restarts=0, event_stream=stream
        )
        for i in range(2)
    }
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _router(make_server: Any, redis_url: str) -> Any:
    # An hour between polls: only the streams (and the snapshot at start) update the index.
    return make_server(
        policy="prefix_aware",
        redis_url=redis_url,
        redis_namespace=NAMESPACE,
        poll_interval_s=3600.0,
    )


def test_blocks_reach_the_index_through_the_stream(make_server: Any, redis_url: str) -> None:
    import redis

    server = _router(make_server, redis_url)
    pool = server.router.pool
    assert isinstance(pool.events, RedisStreamEvents)
    assert all(s.streamed for s in pool.states()), "every worker publishes to the stream"
    pb_grpc.AdminStub(server.channel()).Flush(pb.FlushRequest())
    events_before, resyncs_before = pool.events.num_events, pool.num_resyncs

    first = serve_ids(server, GROUPS[0] + [200])
    holder = WorkerId(first.worker_id)
    # The answer is complete only once the index holds its blocks (read-your-writes): they
    # came through the stream, as the router's polls carry no events and it took no snapshot.
    assert pool.index.num_blocks(holder) >= PREFIX_LEN // 4
    assert pool.events.num_events > events_before
    assert pool.num_resyncs == resyncs_before
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    assert client.xlen(stream_key(NAMESPACE, holder)) > 0

    second = serve_ids(server, GROUPS[0] + [201])
    assert second.worker_id == holder
    assert sum(second.cached_tokens.values()) >= PREFIX_LEN
    assert not any(s.stream_lagging for s in pool.states())


def test_two_routers_on_one_redis_route_identically(make_server: Any, redis_url: str) -> None:
    first, second = _router(make_server, redis_url), _router(make_server, redis_url)
    assert_two_routers_route_alike(first, second, turns=3, suffix=210)
    # Both followed the same streams into one index: the second applied nothing twice.
    for router in (first, second):
        assert router.router.pool.events.num_errors == 0
    first.router.pool.index.check_integrity()


def test_a_gap_or_a_past_life_in_the_stream_resyncs(make_server: Any, redis_url: str) -> None:
    import redis

    from cachesvc.kv.events import BlockStored
    from cachesvc.kv.events_redis import encode_event

    server = _router(make_server, redis_url)
    pool = server.router.pool
    holder = WorkerId(serve_ids(server, GROUPS[2] + [230]).worker_id)
    state = pool.state(holder)
    held = pool.index.num_blocks(holder)
    # Entries no worker wrote (a lost event cannot be made on demand): one that skips ahead in
    # this life, one of a past life. The first is a gap; the second a life the worker no
    # longer lives. Each costs one snapshot, and the index stays what the worker holds.
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    bogus = BlockStored(state.stream_seq + 1000, "hbm", ())
    resyncs = pool.num_resyncs
    for incarnation in (state.incarnation, "a-past-life"):
        client.xadd(stream_key(NAMESPACE, holder), encode_event(incarnation, bogus))
    deadline = time.monotonic() + 10
    while pool.num_resyncs < resyncs + 2:
        assert time.monotonic() < deadline, "the router did not resync"
        time.sleep(0.02)
    assert pool.index.num_blocks(holder) == held
    usage = serve_ids(server, GROUPS[2] + [231])  # later events still apply after the snapshot
    assert usage.worker_id == holder and sum(usage.cached_tokens.values()) >= PREFIX_LEN
    assert not state.stream_lagging


def test_a_killed_worker_leaves_the_index(
    make_server: Any, redis_url: str, worker_pair: dict[WorkerId, Any]
) -> None:
    import ray

    server = _router(make_server, redis_url)
    pool = server.router.pool
    holder = WorkerId(serve_ids(server, GROUPS[1] + [220]).worker_id)
    assert pool.index.num_blocks(holder) > 0
    ray.kill(worker_pair[holder])
    survivor = serve_ids(server, GROUPS[1] + [221]).worker_id  # retried on the other worker
    assert survivor != holder
    assert pool.index.num_blocks(holder) == 0
    assert holder not in pool.index.workers()
