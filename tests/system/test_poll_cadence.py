"""How often the router asks a busy worker for its load and KV events: rarely by the clock
(`busy_poll_interval_s`: each round of Ray calls takes CPU from the worker's steps), and at once
when a request's prompt has been computed there, so its blocks reach the prefix index while the
request still decodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from suite_support import wait_for
from worker_support import in_worker, spawn_one

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system
PROMPT = list(range(40, 40 + 4 * 16 + 5))  # four full blocks of 16 and a partial one
STEP_S = 0.2  # each decode step of the slowed worker: 40 tokens take 8 s


@pytest.fixture
def one_worker(ray_cluster: None, engine_config: EngineConfig) -> Iterator[Any]:
    import ray

    actor = spawn_one(engine_config, "worker-0")
    yield actor
    ray.kill(actor)


def _sleep_before_each_step(actor: Any, step_s: float) -> None:
    def arm(worker: Any) -> None:
        import time as worker_time

        runner = worker._engine.engine.runner
        original = runner.execute

        def slow(*args: Any, **kwargs: Any) -> Any:
            worker_time.sleep(step_s)  # releases the GIL: the actor answers polls meanwhile
            return original(*args, **kwargs)

        runner.execute = slow

    in_worker(actor, arm)


def _indexed(admin: pb_grpc.AdminStub) -> tuple[int, int]:
    [info] = admin.ListWorkers(pb.ListWorkersRequest()).workers
    return info.num_indexed_blocks, info.num_inflight


def test_a_prompts_blocks_are_indexed_while_it_decodes_with_no_clock_poll(
    one_worker: Any, start_router: Any
) -> None:
    # No round by the clock after the first: only the prefill's own poll can index the blocks.
    server = start_router(
        {WorkerId("worker-0"): one_worker}, poll_interval_s=3600.0, busy_poll_interval_s=3600.0
    )
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    wait_for(lambda: _indexed(admin) == (0, 0), 30, "the router's first round")
    _sleep_before_each_step(one_worker, STEP_S)
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT)),
        sampling=pb.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    )
    stream = stub.Generate(request, timeout=120)
    first = next(stream)
    assert first.token_ids
    in_flight: list[int] = []

    def blocks_indexed() -> bool:
        blocks, inflight = _indexed(admin)
        in_flight.append(inflight)
        return blocks >= 4

    wait_for(blocks_indexed, 5, "the prompt's blocks in the index")
    # Seen while the request still decodes (its end syncs the index too, 8 s of steps later).
    assert in_flight[-1] == 1
    rest = list(stream)
    assert sum(len(m.token_ids) for m in [first, *rest]) == 40
