"""A worker killed with ray.kill while it streams: the router resumes the request on the other
worker from the prompt plus the tokens already sent, and the client's one stream ends with the
same tokens and text as an undisturbed run, greedy or seeded sampling, one sample or several."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system
MAX_TOKENS = 200
SAMPLING = {
    "greedy": pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, top_k=50, seed=1234, ignore_eos=True
    ),
    # Each unfinished sample continues as its own request on the other worker.
    "seeded-n3": pb.SamplingParams(
        max_tokens=MAX_TOKENS, temperature=1.0, top_k=50, seed=99, n=3, ignore_eos=True
    ),
}


@pytest.fixture(scope="module", params=sorted(SAMPLING))
def sampling(request: pytest.FixtureRequest) -> pb.SamplingParams:
    return SAMPLING[request.param]


@pytest.fixture(scope="module")
def worker_pair(
    sampling: pb.SamplingParams, ray_cluster: None, engine_config: EngineConfig
) -> Iterator[dict[WorkerId, Any]]:
    """A fresh pair for each sampling mode: the test kills one of them."""
    import ray

    from workers.spawn import spawn_worker

    actors = {
        WorkerId(f"worker-{i}"): spawn_worker(
            f"worker-{i}", engine_config, num_cpus=0.5, max_restarts=0
        )
        for i in range(2)
    }
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _serving_worker(admin: pb_grpc.AdminStub) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = admin.ListWorkers(pb.ListWorkersRequest()).workers
        busy = [w.worker_id for w in workers if w.num_inflight]
        if busy:
            return busy[0]
        time.sleep(0.01)
    raise AssertionError("no worker is serving the stream")


def _tokens(messages: list[pb.GenerateResponse], index: int) -> list[int]:
    return [t for m in messages if m.index == index for t in m.token_ids]


def test_killed_mid_stream_the_client_sees_one_stream(
    make_server: Any, worker_pair: Any, sampling: pb.SamplingParams
) -> None:
    import ray

    def _request(ids: list[int]) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)), sampling=sampling
        )

    server = make_server(policy="prefix_aware")
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    ids = [5, 17, 33, 99, 250, 3, 8, 64, 120, 7, 11]

    n = max(1, sampling.n)
    undisturbed = list(stub.Generate(_request(ids), timeout=120))
    expected = {i: _tokens(undisturbed, i) for i in range(n)}
    assert all(len(t) == MAX_TOKENS for t in expected.values())
    assert n == 1 or expected[0] != expected[1], "samples differ"

    stream = stub.Generate(_request(ids), timeout=120)
    received = [next(stream) for _ in range(3 * n)]
    victim = _serving_worker(admin)
    ray.kill(worker_pair[victim])
    received += list(stream)

    for i in range(n):
        assert _tokens(received, i) == expected[i], "the continuation must be identical"
        own = [m for m in received if m.index == i]
        assert "".join(m.text for m in own) == "".join(m.text for m in undisturbed if m.index == i)
        finals = [m for m in own if m.finish_reason]
        assert len(finals) == 1 and finals[0] is own[-1] and own[-1].finish_reason == "length"
        usage = own[-1].usage
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == MAX_TOKENS
        assert usage.worker_id != victim
    assert received[-1].finish_reason

    stats = admin.Stats(pb.StatsRequest())
    assert stats.num_failed == 0 and stats.num_retries == 1
    workers = {w.worker_id: w for w in admin.ListWorkers(pb.ListWorkersRequest()).workers}
    assert workers[victim].health == pb.WorkerInfo.DEAD
    assert workers[victim].num_indexed_blocks == 0, "the dead worker's blocks leave the index"
    metrics = server.router.metrics
    assert metrics.retries.labels("mid_stream")._value.get() == 1
