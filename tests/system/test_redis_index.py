"""Routers sharing the prefix index in a real redis-server: two routers route every group to the
same worker whichever of them gets the request, and a restarted router routes by cache at once,
without a snapshot of any worker."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system
PREFIX_LEN = 24  # six blocks of 4 tokens
GROUPS = [[10 + 7 * g + i for i in range(PREFIX_LEN)] for g in range(4)]


def _serve(server: Any, ids: list[int]) -> pb.Usage:
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=60))[-1].usage


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
    pb_grpc.AdminStub(first.channel()).Flush(pb.FlushRequest())
    served: dict[int, list[str]] = {}
    for turn in range(4):
        for g, prefix in enumerate(GROUPS):
            router = (first, second)[(turn + g) % 2]
            usage = _serve(router, prefix + [200 + turn])
            served.setdefault(g, []).append(usage.worker_id)
            if turn:
                assert sum(usage.cached_tokens.values()) >= PREFIX_LEN, (g, turn)
    for g, workers in served.items():
        assert len(set(workers)) == 1, f"group {g} was split between workers: {served}"
    assert len({w[0] for w in served.values()}) == 2, "groups should use both workers"


def test_restarted_router_routes_by_cache_at_once(make_server: Any, redis_url: str) -> None:
    namespace = f"restart-{uuid.uuid4().hex[:8]}"
    before = _shared(make_server, redis_url, namespace)
    pb_grpc.AdminStub(before.channel()).Flush(pb.FlushRequest())
    holders = {g: _serve(before, prefix + [201]).worker_id for g, prefix in enumerate(GROUPS)}
    assert len(set(holders.values())) == 2
    before.stop()

    after = _shared(make_server, redis_url, namespace)
    assert after.router.pool.num_resyncs == 0, "the index in Redis was current: no snapshot"
    for g, prefix in enumerate(GROUPS):
        usage = _serve(after, prefix + [202])
        assert usage.worker_id == holders[g]
        assert sum(usage.cached_tokens.values()) >= PREFIX_LEN
