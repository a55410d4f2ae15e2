"""Many streams of a worker over one Ray stream (`router/pool/worker_mux.py`, `workers/mux.py`):
the same tokens as a Ray stream per request, fewer items than deltas, a cancelled stream aborted
on the worker while the others go on, and a mux the worker ended replaced for the next request."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from suite_support import wait_for
from worker_support import in_worker, spawn_one

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system
WORKER = WorkerId("worker-0")


@pytest.fixture
def one_worker(ray_cluster: None, engine_config: EngineConfig) -> Iterator[Any]:
    import ray

    actor = spawn_one(engine_config, "worker-0")
    yield actor
    ray.kill(actor)


def _request(seed: int, max_tokens: int) -> pb.GenerateRequest:
    prompt = [(seed * 7 + i) % 200 + 3 for i in range(9 + seed)]
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=prompt)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        no_response_cache=True,
    )


def _tokens(stub: pb_grpc.InferenceStub, request: pb.GenerateRequest) -> list[int]:
    return [t for delta in stub.Generate(request, timeout=120) for t in delta.token_ids]


def _concurrently(server: Any, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    stub = pb_grpc.InferenceStub(server.channel())
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: _tokens(stub, r), requests))


def _running(actor: Any) -> int:
    return int(in_worker(actor, lambda worker: worker._engine.load.num_running))


def test_streams_on_a_mux_get_the_tokens_of_streams_of_their_own_in_fewer_items(
    one_worker: Any, start_router: Any
) -> None:
    requests = [_request(seed, 24) for seed in range(6)]
    muxed = start_router({WORKER: one_worker})
    got = _concurrently(muxed, requests)
    mux = muxed.router.pool._muxes[WORKER]
    muxed.stop()
    own = start_router({WORKER: one_worker}, multiplex_streams=False)
    assert got == _concurrently(own, requests)
    assert all(len(tokens) == 24 for tokens in got)
    # 6 streams of 24 tokens: at least 150 items (deltas and ends), in far fewer batches when
    # steps advance several streams at once (one batch per item would be a Ray item per delta).
    assert mux.num_items >= 150
    assert mux.num_batches < mux.num_items / 2
    assert not own.router.pool._muxes


def test_a_cancelled_stream_is_aborted_on_the_worker_and_the_others_go_on(
    one_worker: Any, start_router: Any
) -> None:
    server = start_router({WORKER: one_worker})
    stub = pb_grpc.InferenceStub(server.channel())
    long = stub.Generate(_request(1, 400), timeout=120)
    next(long)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(_tokens, stub, _request(2, 40))
        long.cancel()
        assert len(other.result(timeout=120)) == 40
    wait_for(lambda: _running(one_worker) == 0, 30, "the cancelled request aborted")
    assert len(_tokens(stub, _request(3, 5))) == 5  # the same mux serves on


def test_a_mux_the_worker_ended_is_replaced_for_the_next_request(
    one_worker: Any, start_router: Any
) -> None:
    server = start_router({WORKER: one_worker})
    stub = pb_grpc.InferenceStub(server.channel())
    assert len(_tokens(stub, _request(1, 4))) == 4
    first = server.router.pool._muxes[WORKER]
    in_worker(one_worker, lambda worker: worker._muxes.end_all())
    wait_for(lambda: first.spent, 30, "the router saw the mux end")
    assert len(_tokens(stub, _request(2, 4))) == 4
    assert server.router.pool._muxes[WORKER] is not first
