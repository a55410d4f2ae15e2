"""Prefix groups, greedy requests and a two-router check, shared by the system tests of routers
that share what they know through Redis (the index itself, or the workers' event streams)."""

from __future__ import annotations

from typing import Any

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

PREFIX_LEN = 24  # six blocks of 4 tokens
GROUPS = [[10 + 7 * g + i for i in range(PREFIX_LEN)] for g in range(4)]


def serve_ids(server: Any, ids: list[int]) -> pb.Usage:
    """Generate two greedy tokens after `ids`; the usage of the answer."""
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=60))[-1].usage


def tokens_and_usage(server: Any, ids: list[int]) -> tuple[list[int], pb.Usage]:
    """Generate four greedy tokens after `ids`; the tokens and the usage of the answer."""
    stub = pb_grpc.InferenceStub(server.channel())
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    responses = list(stub.Generate(request, timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1].usage


def assert_two_routers_route_alike(first: Any, second: Any, turns: int, suffix: int) -> None:
    """Alternate the groups' requests between two routers: after the first turn every request
    hits its group's prefix, each group stays on one worker, and both workers get groups."""
    pb_grpc.AdminStub(first.channel()).Flush(pb.FlushRequest())
    served: dict[int, list[str]] = {}
    for turn in range(turns):
        for g, prefix in enumerate(GROUPS):
            router = (first, second)[(turn + g) % 2]
            usage = serve_ids(router, prefix + [suffix + turn])
            served.setdefault(g, []).append(usage.worker_id)
            if turn:
                assert sum(usage.cached_tokens.values()) >= PREFIX_LEN, (g, turn)
    for g, workers in served.items():
        assert len(set(workers)) == 1, f"group {g} was split between workers: {served}"
    assert len({w[0] for w in served.values()}) == 2, "groups should use both workers"
