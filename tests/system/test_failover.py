"""A worker killed with ray.kill: a request routed to it before anyone noticed is retried on
the survivor, and the dead worker leaves routing."""

from __future__ import annotations

from typing import Any

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system


def _serve(stub: pb_grpc.InferenceStub, ids: list[int]) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    return list(stub.Generate(request, timeout=60))[-1]


def test_request_for_a_killed_worker_is_retried(make_server: Any, worker_pair: Any) -> None:
    import ray

    # Polls far apart: the router learns of the death only from the failed call itself.
    server = make_server(policy="prefix_aware", poll_interval_s=30.0)
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    prefix = list(range(10, 50))

    first = _serve(stub, prefix + [1])
    holder = first.usage.worker_id
    again = _serve(stub, prefix + [2])
    assert again.usage.worker_id == holder  # the prefix pins the group to one worker
    assert sum(again.usage.cached_tokens.values()) >= 36

    ray.kill(worker_pair[holder])
    retried = _serve(stub, prefix + [3])
    survivor = retried.usage.worker_id
    assert survivor != holder
    assert retried.finish_reason == "length" and retried.usage.completion_tokens == 4

    stats = admin.Stats(pb.StatsRequest())
    assert stats.num_retries >= 1 and stats.num_failed == 0
    health = {w.worker_id: w.health for w in admin.ListWorkers(pb.ListWorkersRequest()).workers}
    assert health[holder] == pb.WorkerInfo.DEAD
    assert health[survivor] == pb.WorkerInfo.HEALTHY
    # Later requests go straight to the survivor and hit the prefix it now holds.
    later = _serve(stub, prefix + [4])
    assert later.usage.worker_id == survivor
    assert sum(later.usage.cached_tokens.values()) >= 36
