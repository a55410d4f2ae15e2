"""Liveness on real Ray workers: a worker whose every step outlasts the router's call and ping
timeouts stays healthy and serves every request to the end; a worker truly frozen (SIGSTOP) or
whose event loop stopped turning while its process still answers is found out and failed over.

The slow steps are made: the tiny model steps in milliseconds, so each step of the worker is
lengthened by a busy loop in the step's own thread (holding the GIL like a real CPU-bound
step, which is the harder case for the pings' thread). That is the only fake here."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from suite_support import wait_for
from worker_support import pid_of, spawn_one, worker_health

from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system
STEP_S = 1.5  # every step of a slowed worker, longer than any timeout below
SHORT = {
    "call_timeout_s": 0.3,
    "ping_timeout_s": 1.0,
    "max_missed_polls": 2,
    "stall_check_s": 0.1,
    "poll_interval_s": 0.05,
}
# For the hang tests: pings get a long timeout, so that on a busy machine a late answer is not
# counted as missed before the stall is seen (the test checks which of the two found it).
HANG = {**SHORT, "ping_timeout_s": 5.0, "hang_after_s": 2.0}
PROMPTS = [[7 + 13 * p + i for i in range(30 + 5 * p)] for p in range(6)]
MAX_TOKENS = 4


def _slow_steps(actor: Any, step_s: float) -> None:
    """Make every engine step of the worker take at least `step_s` (0: as fast as it is)."""
    import ray

    def arm(worker: Any) -> None:
        runner = worker._engine.engine.runner
        original = getattr(runner, "_unslowed", runner.execute)
        runner._unslowed = original

        def slow(*args: Any, **kwargs: Any) -> Any:
            end = time.perf_counter() + step_s
            while time.perf_counter() < end:  # CPU-bound, in Python: holds the GIL
                pass
            return original(*args, **kwargs)

        runner.execute = slow if step_s > 0 else original

    ray.get(actor.__ray_call__.remote(arm), timeout=60)


def _hang_next_step(actor: Any) -> None:
    """Make the worker's next engine step never end (its process and pings live on)."""
    import ray

    def arm(worker: Any) -> None:
        runner = worker._engine.engine.runner
        runner.execute = lambda *args, **kwargs: threading.Event().wait()

    ray.get(actor.__ray_call__.remote(arm), timeout=60)


def _request(ids: list[int], max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def _generate_all(stub: pb_grpc.InferenceStub) -> dict[int, list[pb.GenerateResponse] | str]:
    """Every prompt at once; per prompt its messages, or the status code it failed with."""
    results: dict[int, list[pb.GenerateResponse] | str] = {}

    def one(p: int) -> None:
        try:
            results[p] = list(stub.Generate(_request(PROMPTS[p]), timeout=300))
        except grpc.RpcError as exc:
            results[p] = str(exc.code())

    threads = [threading.Thread(target=one, args=(p,)) for p in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    return results


def _unhealthy_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "unhealthy" in r.getMessage()]


@pytest.fixture
def one_worker(ray_cluster: None, engine_config: EngineConfig) -> Iterator[Any]:
    import ray

    actor = spawn_one(engine_config, "worker-0")
    yield actor
    ray.kill(actor)


@pytest.fixture
def two_workers(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    import ray

    pair = {WorkerId(f"worker-{i}"): spawn_one(engine_config, f"worker-{i}") for i in range(2)}
    yield pair
    for actor in pair.values():
        ray.kill(actor)


class Failover:
    """One stream over two workers, a fault injected into the worker that serves it once the
    stream has started; checks the stream ends on the other worker with the clean tokens."""

    def __init__(self, server: Any) -> None:
        self.stub = pb_grpc.InferenceStub(server.channel())
        self.admin = pb_grpc.AdminStub(server.channel())
        self.request = _request(PROMPTS[0], max_tokens=12)
        self.clean = _tokens(list(self.stub.Generate(self.request, timeout=120)))

    def run(self, fault: Callable[[WorkerId], None]) -> WorkerId:
        stream = self.stub.Generate(self.request, timeout=300)
        received = [next(stream)]
        workers = self.admin.ListWorkers(pb.ListWorkersRequest()).workers
        [victim] = [WorkerId(w.worker_id) for w in workers if w.num_inflight]
        fault(victim)
        received += list(stream)  # the rest comes from the other worker
        assert _tokens(received) == self.clean
        assert received[-1].usage.worker_id != victim
        assert worker_health(self.admin)[victim] == pb.WorkerInfo.UNHEALTHY
        return victim


def test_steps_longer_than_every_timeout_keep_a_live_worker_healthy(
    one_worker: Any, start_router: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router")
    server = start_router({WorkerId("worker-0"): one_worker}, **SHORT)
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    clean = {p: _tokens(list(stub.Generate(_request(ids)))) for p, ids in enumerate(PROMPTS)}
    _slow_steps(one_worker, STEP_S)
    try:
        results = _generate_all(stub)
    finally:
        _slow_steps(one_worker, 0)
    failed = {p: r for p, r in results.items() if isinstance(r, str)}
    assert not failed, f"requests failed on a live worker: {failed}"
    for p, messages in results.items():
        assert isinstance(messages, list)
        assert _tokens(messages) == clean[p]
        assert messages[-1].usage.worker_id == "worker-0"
    assert not _unhealthy_logs(caplog)
    assert worker_health(admin)["worker-0"] == pb.WorkerInfo.HEALTHY
    stats = admin.Stats(pb.StatsRequest())
    assert stats.num_failed == 0 and stats.num_retries == 0


def test_a_frozen_process_among_slow_steps_is_failed_over(
    two_workers: dict[WorkerId, Any], start_router: Any
) -> None:
    run = Failover(start_router(two_workers, **SHORT))
    for actor in two_workers.values():
        _slow_steps(actor, STEP_S)  # both live workers outlast every timeout at each step
    frozen: list[int] = []

    def freeze(victim: WorkerId) -> None:
        frozen.append(pid_of(two_workers[victim]))
        os.kill(frozen[-1], signal.SIGSTOP)

    try:
        victim = run.run(freeze)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    wait_for(
        lambda: worker_health(run.admin)[victim] == pb.WorkerInfo.HEALTHY, 60, "the thawed one"
    )


def test_a_step_that_never_ends_is_a_hang_though_pings_answer(
    two_workers: dict[WorkerId, Any], start_router: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router")
    run = Failover(start_router(two_workers, **HANG))
    run.run(lambda victim: _hang_next_step(two_workers[victim]))
    [reason] = _unhealthy_logs(caplog)
    assert "no progress" in reason  # found stuck by its pings' answers, not by missing them


def test_an_event_loop_that_stopped_turning_is_a_hang_though_pings_answer(
    two_workers: dict[WorkerId, Any], start_router: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router")
    run = Failover(start_router(two_workers, **HANG))
    for actor in two_workers.values():
        _slow_steps(actor, 0.5)  # the stream is still running when the loop stops

    def block_loop(victim: WorkerId) -> None:
        import ray

        def block(worker: Any) -> None:  # the actor's loop runs its tick task
            worker._ticking.get_loop().call_soon_threadsafe(time.sleep, 30)

        ray.get(two_workers[victim].__ray_call__.remote(block), timeout=60)

    victim = run.run(block_loop)
    [reason] = _unhealthy_logs(caplog)
    assert "no progress" in reason and "event loop" in reason
    wait_for(
        lambda: worker_health(run.admin)[victim] == pb.WorkerInfo.HEALTHY, 90, "its loop again"
    )
