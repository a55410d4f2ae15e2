"""Workers started by role on a real Ray cluster: each says its role in its info, and a worker
replaced after its death comes back with the same role (not as a mixed one)."""

from __future__ import annotations

import uuid
from typing import Any

from cachesvc.kv.types import WorkerId
from workers.cluster import WorkerGroup, replace_worker, spawn_workers, stop_workers
from workers.config import EngineConfig
from workers.protocol import WorkerInfo


def _info(actor: Any) -> WorkerInfo:
    import ray

    info: WorkerInfo = ray.get(actor.info.remote(), timeout=300)
    return info


def test_prefill_and_decode_workers_say_their_role_and_a_replaced_one_keeps_it(
    ray_cluster: None, engine_config: EngineConfig
) -> None:
    group = WorkerGroup(
        engine_config,
        num_workers=2,
        # A namespace of its own: spawn_workers refuses one where workers already run.
        namespace=f"roles-{uuid.uuid4().hex[:8]}",
        device="cpu",
        # Half a CPU each: the session's cluster has two, and other modules' workers may live.
        num_cpus_per_worker=0.5,
        num_prefill=1,
        num_decode=1,
    )
    actors = spawn_workers(group)
    try:
        first = {worker: _info(actor) for worker, actor in actors.items()}
        assert {worker: info.role for worker, info in first.items()} == {
            "worker-0": "prefill",
            "worker-1": "decode",
        }
        actors[WorkerId("worker-1")] = replace_worker(group, WorkerId("worker-1"))
        replaced = _info(actors[WorkerId("worker-1")])
        assert replaced.incarnation != first["worker-1"].incarnation  # a new actor indeed
        assert replaced.role == "decode"
    finally:
        stop_workers(actors, close_timeout_s=30)
