"""Hand-offs that do not happen, on real Ray workers: the prefill worker keeps a handed-off
prompt's blocks pinned for the decode worker's pull (`hold_kv`), and lets them go as soon as
no pull will come: a first token that ends the request, a client gone during the prefill. Its
free blocks are what they were before the request (within the wait below, far shorter than the
30 s a forgotten hold stays pinned)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from pd_support import slow_steps, spawn_pulling

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system

PREFILL, DECODE = WorkerId("prefill-0"), WorkerId("decode-0")
SETTLE_S = 10.0  # how long the pins may take to go (a forgotten hold keeps them 30 s)


@pytest.fixture(scope="module")
def roles(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    """One prefill worker computing prompts 8 tokens a step, and one decode worker."""
    import ray

    overrides = {PREFILL: {"max_num_batched_tokens": 8}}
    actors = spawn_pulling(engine_config, {PREFILL: "prefill", DECODE: "decode"}, overrides)
    yield actors
    for actor in actors.values():
        ray.kill(actor)


def _prompt(seed: int, num_tokens: int = 42) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 3 for j in range(num_tokens)]


def _request(ids: list[int], sampling: pb.SamplingParams) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)), sampling=sampling)


def _free(actor: Any) -> tuple[int, float]:
    """The worker's free device blocks now (its load report counts them as of its last step),
    and the blocks its holds keep pinned."""
    import ray

    def read(worker: Any) -> tuple[int, float]:
        held = worker._exporter.holds.counters()["peer_held_blocks"]
        return worker._engine.engine.pool.num_free, held

    free, held = ray.get(actor.__ray_call__.remote(read), timeout=60)
    return int(free), float(held)


def _settled(actor: Any, free_before: int) -> tuple[int, float]:
    deadline = time.monotonic() + SETTLE_S
    while True:
        free, held = _free(actor)
        if (free, held) == (free_before, 0.0) or time.monotonic() > deadline:
            return free, held
        time.sleep(0.2)


def test_a_first_token_that_ends_the_request_lets_the_pins_go(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    server = start_router(roles, pd_mode="always")
    stub = pb_grpc.InferenceStub(server.channel())
    ids = _prompt(1)
    greedy = pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = [t for m in stub.Generate(_request(ids, greedy), timeout=120) for t in m.token_ids]
    pb_grpc.AdminStub(server.channel()).Flush(pb.FlushRequest(), timeout=60)
    free_before, _ = _free(roles[PREFILL])
    # Its first token is a stop token: the request ends on the prefill worker, no pull comes.
    stopped = pb.SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=first)
    messages = list(stub.Generate(_request(ids, stopped), timeout=120))
    assert messages[-1].finish_reason == "stop"
    assert messages[-1].usage.worker_id == PREFILL
    assert _settled(roles[PREFILL], free_before) == (free_before, 0.0)


def test_a_client_gone_during_the_prefill_lets_the_pins_go(
    start_router: Any, roles: dict[WorkerId, Any]
) -> None:
    server = start_router(roles, pd_mode="always")
    stub = pb_grpc.InferenceStub(server.channel())
    free_before, _ = _free(roles[PREFILL])
    slow_steps(roles[PREFILL], 0.3)  # 8 tokens a step: a 200-token prompt takes 25 steps
    try:
        sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        call = stub.Generate(_request(_prompt(2, 200), sampling), timeout=120)
        received: list[Any] = []
        reader = threading.Thread(target=lambda: _read(call, received), daemon=True)
        reader.start()
        time.sleep(3.0)  # some chunks computed and pinned, the first token far off
        call.cancel()
        reader.join(30)
        assert not any(m.token_ids for m in received)
    finally:
        slow_steps(roles[PREFILL], 0.0)
    assert _settled(roles[PREFILL], free_before) == (free_before, 0.0)


def _read(call: Any, received: list[Any]) -> None:
    with contextlib.suppress(grpc.RpcError):  # cancelled
        received.extend(call)
