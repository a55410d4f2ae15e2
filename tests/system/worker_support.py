"""The worker actors of the system tests: one spawned as the tests spawn them, code run in its
process, its pid, the health a router lists for each, and its engine steps held at a gate."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig


def spawn_one(config: EngineConfig, worker: str) -> Any:
    """A worker actor on half a CPU (two fit beside a pair being torn down), never restarted
    by Ray: a test that kills it sees it dead."""
    from workers.spawn import spawn_worker

    return spawn_worker(worker, config, num_cpus=0.5, max_restarts=0)


def in_worker(actor: Any, fn: Callable[[Any], Any]) -> Any:
    """`fn(worker)` run in the actor's process on its `Worker` object; its result. `fn` travels
    by value (cloudpickle): a lambda or a function nested in the caller, never a module-level
    one of a test module, which the worker could not import."""
    import ray

    return ray.get(actor.__ray_call__.remote(fn), timeout=60)


def pid_of(actor: Any) -> int:
    """The process id of a worker actor (on this machine)."""
    return int(in_worker(actor, lambda worker: os.getpid()))


def worker_health(admin: pb_grpc.AdminStub) -> dict[str, int]:
    """Each worker's health (`WorkerInfo.Health`) as the router lists it."""
    return {w.worker_id: w.health for w in admin.ListWorkers(pb.ListWorkersRequest()).workers}


class StepGate:
    """Holds the worker's engine steps at a gate, in the step's thread (the actor's loop goes
    on: it answers pings and takes aborts, which wait for the held step), and counts the steps
    that pass once it opens: what a request did on the worker, in steps, however fast the
    machine is. `remove` puts the steps back as they were."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

        def install(worker: Any) -> None:
            import threading

            runner = worker._engine.engine.runner
            original = getattr(runner, "_ungated", runner.execute)
            gate, counts = threading.Event(), {"held": 0, "passed": 0}

            def gated(*args: Any, **kwargs: Any) -> Any:
                counts["held"] += 1
                gate.wait()
                counts["held"] -= 1
                counts["passed"] += 1
                return original(*args, **kwargs)

            runner._ungated, runner._gate, runner._gate_counts = original, gate, counts
            runner.execute = gated

        in_worker(actor, install)

    def num_held(self) -> int:
        """Steps waiting at the gate now."""
        return int(in_worker(self._actor, lambda w: w._engine.engine.runner._gate_counts["held"]))

    def num_passed(self) -> int:
        """Steps that went through the gate since it opened."""
        return int(in_worker(self._actor, lambda w: w._engine.engine.runner._gate_counts["passed"]))

    def has_waiting_call(self) -> bool:
        """An engine call (an abort, an added request) waits for the held step to end."""
        return bool(in_worker(self._actor, lambda w: len(w._engine._deferred)))

    def open(self) -> None:
        in_worker(self._actor, lambda w: w._engine.engine.runner._gate.set())

    def remove(self) -> None:
        def restore(worker: Any) -> None:
            runner = worker._engine.engine.runner
            runner._gate.set()  # a step still held goes on
            runner.execute = runner._ungated

        in_worker(self._actor, restore)
