"""The supervisor on real Ray workers: a frozen worker's stream fails over and the worker comes
back when it thaws; a worker dead for good is replaced; health follows."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from suite_support import wait_for
from worker_support import pid_of, spawn_one, worker_health

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system
FAST = {"ping_timeout_s": 0.5, "max_missed_polls": 2, "stall_check_s": 0.2}


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=[5, 17, 33, 99, 250, 3, 8, 64])),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


@pytest.fixture
def actors(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    import ray

    pair = {WorkerId(f"worker-{i}"): spawn_one(engine_config, f"worker-{i}") for i in range(2)}
    yield pair
    for actor in pair.values():
        ray.kill(actor)


def test_a_frozen_worker_s_stream_fails_over_and_the_worker_comes_back(
    actors: dict[WorkerId, Any], start_router: Any
) -> None:
    server = start_router(actors, **FAST)
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    pids = {worker: pid_of(actor) for worker, actor in actors.items()}
    max_tokens = 400
    expected = [t for m in stub.Generate(_request(max_tokens), timeout=120) for t in m.token_ids]
    stream = stub.Generate(_request(max_tokens), timeout=120)
    received = [next(stream)]
    workers = admin.ListWorkers(pb.ListWorkersRequest()).workers
    [victim] = [w.worker_id for w in workers if w.num_inflight]
    os.kill(pids[WorkerId(victim)], signal.SIGSTOP)
    try:
        received += list(stream)  # the rest comes from the other worker
        assert [t for m in received for t in m.token_ids] == expected
        assert received[-1].usage.worker_id != victim
        assert worker_health(admin)[victim] == pb.WorkerInfo.UNHEALTHY
    finally:
        os.kill(pids[WorkerId(victim)], signal.SIGCONT)
    wait_for(lambda: worker_health(admin)[victim] == pb.WorkerInfo.HEALTHY, 30, "the thawed worker")
    assert admin.Stats(pb.StatsRequest()).num_failed == 0


def test_a_worker_dead_for_good_is_replaced_and_health_follows(
    ray_cluster: None, engine_config: EngineConfig, start_router: Any
) -> None:
    import ray

    gate = threading.Event()
    spawned: list[Any] = []

    def replace(worker: WorkerId) -> Any:
        assert gate.wait(60), "the test never let the replacement start"
        spawned.append(spawn_one(engine_config, str(worker)))
        return spawned[-1]

    first = spawn_one(engine_config, "worker-0")
    server = start_router({WorkerId("worker-0"): first}, replace, **FAST, replace_backoff_s=0.1)
    try:
        channel = server.channel()
        stub = pb_grpc.InferenceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING

        def status() -> int:
            return int(health.Check(health_pb2.HealthCheckRequest(), timeout=5).status)

        assert status() == serving
        before = list(stub.Generate(_request(4), timeout=60))[-1]
        ray.kill(first)  # max_restarts=0: dead for good
        wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request(4), timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        wait_for(lambda: status() == serving, 120, "SERVING again")
        after = list(stub.Generate(_request(4), timeout=60))[-1]
        assert after.token_ids == before.token_ids or after.finish_reason == "length"
        assert server.router.supervisor.num_replacements == 1
        admin = pb_grpc.AdminStub(channel)
        assert worker_health(admin)["worker-0"] == pb.WorkerInfo.HEALTHY
    finally:
        server.stop()
        for actor in spawned:
            ray.kill(actor)
