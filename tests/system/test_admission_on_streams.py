"""Admission on the streams, with a real worker and router (`admit_itl_ms`): while the streams
a worker decodes get their tokens slower than the target, a request that would join them is
refused with RESOURCE_EXHAUSTED naming the setting; once the worker has no streams, it is
admitted again."""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest
from pd_support import slow_steps

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system


def _request(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _idle(server: Any, worker: Any) -> None:
    deadline = time.monotonic() + 30
    state = server.router.pool.state(worker)
    while state.num_requests:
        assert time.monotonic() < deadline, "the worker did not go idle"
        time.sleep(0.05)


def test_a_worker_whose_streams_are_too_slow_gets_no_more_requests(
    start_router: Any, worker_pair: dict[Any, Any]
) -> None:
    worker, actor = next(iter(worker_pair.items()))
    server = start_router({worker: actor}, admit_itl_ms=50.0)
    stub = pb_grpc.InferenceStub(server.channel())
    slow_steps(actor, 0.2)  # every token 200 ms after the last: four times the target
    try:
        stream = stub.Generate(_request([9, 8, 7, 6, 5], 30), timeout=60)
        for _ in range(4):  # its first token, then three gaps the router measures
            next(stream)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request([3, 4, 5], 2), timeout=30))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "exceeds admit_itl_ms 50 ms" in err.value.details()
        assert f"worker {worker}" in err.value.details()
        replies = list(stream)
        assert replies[-1].finish_reason == "length", "the streams already running are served"
    finally:
        slow_steps(actor, 0)
    assert server.router.metrics.refused._value.get() == 1
    _idle(server, worker)
    # No streams to protect: admitted, however slow its last ones were.
    reply = list(stub.Generate(_request([3, 4, 5], 2), timeout=60))
    assert reply[-1].finish_reason == "length"
