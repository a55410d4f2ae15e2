"""Routers sharing the prefix index in a real redis-server: two routers route every group to the
same worker whichever of them gets the request, and a restarted router routes by cache at once,
without a snapshot of any worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from routing_support import GROUPS, PREFIX_LEN, assert_two_routers_route_alike, serve_ids

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system


def _shared(make_server: Any, redis_url: str, namespace: str, **config: Any) -> Any:
    # Polls far apart: what a router knows of the other's requests comes through Redis.
    config.setdefault("poll_interval_s", 30.0)
    return make_server(
        policy="prefix_aware", redis_url=redis_url, redis_namespace=namespace, **config
    )


def test_two_routers_sharing_redis_route_identically(make_server: Any, redis_url: str) -> None:
    namespace = f"two-{uuid.uuid4().hex[:8]}"
    first = _shared(make_server, redis_url, namespace)
    second = _shared(make_server, redis_url, namespace)
    assert_two_routers_route_alike(first, second, turns=4, suffix=200)


def test_restarted_router_routes_by_cache_at_once(make_server: Any, redis_url: str) -> None:
    namespace = f"restart-{uuid.uuid4().hex[:8]}"
    before = _shared(make_server, redis_url, namespace)
    pb_grpc.AdminStub(before.channel()).Flush(pb.FlushRequest())
    holders = {g: serve_ids(before, prefix + [201]).worker_id for g, prefix in enumerate(GROUPS)}
    assert len(set(holders.values())) == 2
    before.stop()

    after = _shared(make_server, redis_url, namespace)
    assert after.router.pool.num_resyncs == 0, "the index in Redis was current: no snapshot"
    for g, prefix in enumerate(GROUPS):
        usage = serve_ids(after, prefix + [202])
        assert usage.worker_id == holders[g]
        assert sum(usage.cached_tokens.values()) >= PREFIX_LEN
