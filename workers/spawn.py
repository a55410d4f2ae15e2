"""Starting a worker's Ray actor (`WorkerActor`, `workers/actor.py`): its name and namespace,
resources, placement, restarts, and the concurrency group its pings run in."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from cachesvc.kv.events_redis import EventStreamConfig
from workers.actor import LIVENESS_GROUP, WorkerActor
from workers.config import EngineConfig


def spawn_worker(
    worker_id: str,
    config: EngineConfig,
    *,
    name: str | None = None,
    namespace: str | None = None,
    num_cpus: float = 1,
    num_gpus: float = 0,
    resources: Mapping[str, float] | None = None,
    max_restarts: int = 2,
    max_queued_requests: int = 256,
    event_stream: EventStreamConfig | None = None,
    scheduling_strategy: Any = None,
) -> Any:
    """Start a WorkerActor on the connected Ray cluster and return its handle (not waiting
    for the model to load: the first call does).

    `name` names the actor in the Ray `namespace` (default: the driver's), so another router
    can find it; by default a unique name (two pools of one test session never collide).
    `resources` are custom Ray resources it asks for (`workers.cluster.role_resource`). With
    `event_stream` the worker publishes its KV events to Redis. `scheduling_strategy` is Ray's
    (e.g. "SPREAD", or a NodeAffinitySchedulingStrategy); None is Ray's default."""
    import ray

    # Pings get a thread and event loop of their own: never queued behind a step or the loop.
    ray.method(concurrency_group=LIVENESS_GROUP)(WorkerActor.ping)
    remote = ray.remote(concurrency_groups={LIVENESS_GROUP: 1})  # type: ignore[call-overload]
    remote_cls = remote(WorkerActor)
    name = name or f"cachesvc-{worker_id}-{uuid.uuid4().hex[:6]}"
    return remote_cls.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=dict(resources) if resources else None,
        max_restarts=max_restarts,
        # A request never reruns by itself: the router decides whether a retry is safe.
        max_task_retries=0,
        # Streams are long-lived coroutines, not threads: allow many at once.
        max_concurrency=1000,
        scheduling_strategy=scheduling_strategy,
    ).remote(worker_id, config, max_queued_requests, event_stream, name, namespace)
