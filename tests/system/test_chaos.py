"""The fault list in one go, against real Ray workers and a real router: per fault, requests
sent, failed and wrong (against the tokens of a clean run). Every fault must cost 0 wrong
tokens and 0 lost requests; the table is printed (`pytest -s`) for the failure-modes page.

Faults: a worker killed mid-stream (dead for good, then replaced), a worker frozen mid-stream
(SIGSTOP, thawed later), an engine step that raises, another tenant cancelling with the same
request ids, and a flood of prompts at the message size limit.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from worker_support import pid_of, spawn_one

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.tenants import TenantToken
from workers.config import EngineConfig

pytestmark = pytest.mark.system
TENANTS = (TenantToken("acme", "acme-tok"), TenantToken("umbrella", "umbrella-tok"))
ACME = [("authorization", "Bearer acme-tok")]
UMBRELLA = [("authorization", "Bearer umbrella-tok")]
OPERATOR = [("authorization", "Bearer operator-tok")]
MAX_TOKENS = 120
PROMPTS = [[11 + 7 * p + i for i in range(12 + p)] for p in range(6)]
HUGE = "The quick brown fox jumps over the lazy dog. " * 86000  # ~3.9 MB


@dataclass
class Tally:
    fault: str
    sent: int = 0
    failed: int = 0
    wrong: int = 0


def _request(ids: list[int], request_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    )


def _fail_next_step(actor: Any) -> None:
    """Make the worker's next engine step raise (in the worker's own process)."""
    import ray

    def arm(worker: Any) -> None:
        runner = worker._engine.engine.runner
        original = runner.execute

        def failing(*args: Any, **kwargs: Any) -> Any:
            runner.execute = original
            raise RuntimeError("injected step failure")

        runner.execute = failing

    ray.get(actor.__ray_call__.remote(arm), timeout=60)


class Chaos:
    """A router over two workers that may be replaced; runs requests and tallies them."""

    def __init__(self, stub: pb_grpc.InferenceStub, admin: pb_grpc.AdminStub) -> None:
        self.stub, self.admin = stub, admin
        self.clean: dict[int, list[int]] = {}
        self.tallies: list[Tally] = []

    def tokens(self, ids: list[int], metadata: Any = ACME, request_id: str = "") -> list[int]:
        messages = self.stub.Generate(_request(ids, request_id), metadata=metadata, timeout=120)
        return [t for m in messages for t in m.token_ids]

    def run(
        self, fault: str, during: Callable[[str], None], metadata: Any = ACME, rid: str = ""
    ) -> Tally:
        """Send every prompt at once; `during(worker)` injects the fault once a stream runs."""
        tally = Tally(fault)
        results: dict[int, list[int] | None] = {}
        first = threading.Event()

        def one(p: int) -> None:
            try:
                stream = self.stub.Generate(
                    _request(PROMPTS[p], rid), metadata=metadata, timeout=120
                )
                out: list[int] = []
                for message in stream:
                    out += message.token_ids
                    first.set()
                results[p] = out
            except grpc.RpcError:
                results[p] = None

        threads = [threading.Thread(target=one, args=(p,)) for p in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        assert first.wait(60), f"{fault}: no stream started"
        during(self.busy_worker())
        for thread in threads:
            thread.join(120)
        for p in range(len(PROMPTS)):
            tally.sent += 1
            if results.get(p) is None:
                tally.failed += 1
            elif results[p] != self.clean[p]:
                tally.wrong += 1
        self.tallies.append(tally)
        return tally

    def busy_worker(self) -> str:
        workers = self.admin.ListWorkers(pb.ListWorkersRequest(), metadata=OPERATOR).workers
        busy = [w.worker_id for w in workers if w.num_inflight]
        return busy[0] if busy else workers[0].worker_id

    def health(self) -> dict[str, int]:
        workers = self.admin.ListWorkers(pb.ListWorkersRequest(), metadata=OPERATOR).workers
        return {w.worker_id: w.health for w in workers}

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(h == pb.WorkerInfo.HEALTHY for h in self.health().values()):
            assert time.monotonic() < deadline, f"workers not healthy again: {self.health()}"
            time.sleep(0.2)


@pytest.fixture
def chaos(
    ray_cluster: None, engine_config: EngineConfig, start_router: Any
) -> Iterator[tuple[Chaos, dict[WorkerId, Any]]]:
    import ray

    actors = {WorkerId(f"worker-{i}"): spawn_one(engine_config, f"worker-{i}") for i in range(2)}
    spawned = list(actors.values())

    def replace(worker: WorkerId) -> Any:
        actors[worker] = spawn_one(engine_config, str(worker))
        spawned.append(actors[worker])
        return actors[worker]

    server = start_router(
        dict(actors),
        replace,
        auth_token="operator-tok",
        tenant_tokens=TENANTS,
        ping_timeout_s=0.5,
        max_missed_polls=2,
        stall_check_s=0.2,
        replace_backoff_s=0.2,
    )
    channel = server.channel()
    yield Chaos(pb_grpc.InferenceStub(channel), pb_grpc.AdminStub(channel)), actors
    for actor in spawned:
        ray.kill(actor)


def test_every_fault_costs_no_wrong_token_and_no_request(
    chaos: tuple[Chaos, dict[WorkerId, Any]],
) -> None:
    import ray

    run, actors = chaos
    run.clean = {p: run.tokens(ids) for p, ids in enumerate(PROMPTS)}
    assert all(len(t) == MAX_TOKENS for t in run.clean.values())

    run.run("worker killed mid-stream", lambda w: ray.kill(actors[WorkerId(w)]))
    run.wait_healthy()  # replaced

    frozen: list[int] = []

    def freeze(worker: str) -> None:
        frozen.append(pid_of(actors[WorkerId(worker)]))
        os.kill(frozen[-1], signal.SIGSTOP)

    try:
        run.run("worker frozen mid-stream", freeze)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    run.wait_healthy()

    run.run("engine step raises", lambda w: _fail_next_step(actors[WorkerId(w)]))
    # The failed step's blocks were dropped: the same prompts again, now from the cache.
    run.run("same prefixes after the failed step", lambda w: None)

    def cancel_with_same_ids(worker: str) -> None:
        for _ in range(5):
            request = _request(PROMPTS[0], "chaos-id")
            with pytest.raises(grpc.RpcError):
                list(run.stub.Generate(request, metadata=UMBRELLA, timeout=0.01))

    run.run("another tenant cancels the same ids", cancel_with_same_ids, rid="chaos-id")

    def flood(worker: str) -> None:
        def huge() -> None:
            request = pb.GenerateRequest(prompt=pb.Prompt(text=HUGE))
            with pytest.raises(grpc.RpcError) as err:
                list(run.stub.Generate(request, metadata=UMBRELLA, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        threads = [threading.Thread(target=huge) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)

    run.run("flood of 4 MB prompts", flood)

    print("\nfault | sent | failed | wrong")
    for t in run.tallies:
        print(f"{t.fault} | {t.sent} | {t.failed} | {t.wrong}")
    assert all(t.failed == 0 and t.wrong == 0 for t in run.tallies), run.tallies
