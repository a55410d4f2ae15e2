"""A group of worker actors on a Ray cluster: start them, find them, close and stop them.

Workers are named `cachesvc-worker-<i>` in a Ray namespace, so a second router finds them
(`find_workers`). They are not detached actors: named actors are visible to every job of the
cluster while their owner lives, and tying their lifetime to the process that started them
means a crashed owner never leaves workers holding GPUs. Ray is imported inside each function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cachesvc.config import ConfigError, EngineConfig
from cachesvc.events_redis import EventStreamConfig
from cachesvc.types import WorkerId

_log = logging.getLogger(__name__)
_WORKER_NAME = re.compile(r"cachesvc-(worker-\d+)")


class AttachError(ConfigError):
    """No workers to attach to, or workers already running where new ones would start."""


@dataclass(frozen=True)
class WorkerGroup:
    """How a group of workers runs; `device="auto"` takes a GPU when the cluster has one, and
    with `event_stream` the workers publish their KV events to Redis."""

    engine: EngineConfig
    num_workers: int = 1
    namespace: str = "cachesvc"
    device: str = "auto"
    num_cpus_per_worker: float = 1.0
    event_stream: EventStreamConfig | None = None


def spawn_workers(group: WorkerGroup) -> dict[WorkerId, Any]:
    """Start `num_workers` named actors on the connected Ray cluster, in `namespace`; returns
    their handles without waiting for the models to load. Raises AttachError when workers of
    this namespace are already running."""

    from workers.actor import spawn_worker

    running = _named_workers(group.namespace)
    if running:
        raise AttachError(
            f"cachesvc workers are already running in Ray namespace {group.namespace!r} "
            f"({', '.join(sorted(running))}): route over them with `cachesvc serve --attach`, "
            "or start new ones under another --ray-namespace"
        )
    engine, num_cpus, num_gpus = _placement(group)
    return {
        WorkerId(f"worker-{i}"): spawn_worker(
            f"worker-{i}",
            engine,
            name=f"cachesvc-worker-{i}",
            namespace=group.namespace,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            event_stream=group.event_stream,
        )
        for i in range(group.num_workers)
    }


def replace_worker(group: WorkerGroup, worker: WorkerId, name_wait_s: float = 10.0) -> Any:
    """Start a new actor for `worker` of a group `spawn_workers` started (under the same
    name, once the old actor is gone: it is killed first) and return its handle. Blocks until
    Ray has taken the name; raises ValueError when it is still taken after `name_wait_s`."""
    import ray

    from workers.actor import spawn_worker

    name = f"cachesvc-{worker}"
    with contextlib.suppress(ValueError):  # no actor of that name: it is gone already
        ray.kill(ray.get_actor(name, namespace=group.namespace), no_restart=True)
    engine, num_cpus, num_gpus = _placement(group)
    deadline = time.monotonic() + name_wait_s
    while True:
        try:
            return spawn_worker(
                worker,
                engine,
                name=name,
                namespace=group.namespace,
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                event_stream=group.event_stream,
            )
        except ValueError:  # the dead actor's name is released a moment after its death
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _placement(group: WorkerGroup) -> tuple[EngineConfig, float, float]:
    """The engine config and the CPUs and GPUs of each worker of the group."""
    import ray

    resources = ray.cluster_resources()
    engine, num_gpus = group.engine, 0.0
    wants_gpu = group.device == "cuda" or (group.device == "auto" and resources.get("GPU", 0) >= 1)
    if wants_gpu:
        engine, num_gpus = dataclasses.replace(engine, device="cuda"), 1.0
    # More workers than CPUs would wait forever for a CPU: share them instead.
    num_cpus = min(group.num_cpus_per_worker, resources.get("CPU", 1) / group.num_workers)
    return engine, num_cpus, num_gpus


def find_workers(namespace: str, ray_address: str | None = None) -> dict[WorkerId, Any]:
    """Handles of the live workers another process started in `namespace` (for `--attach`);
    raises AttachError when there are none (`ray_address` only words the message)."""
    import ray

    names = _named_workers(namespace)
    if not names:
        address = ray_address or "a new local Ray cluster (pass --ray-address)"
        raise AttachError(
            f"no cachesvc workers in Ray namespace {namespace!r} at {address}: "
            "start `cachesvc serve` there first"
        )
    return {
        WorkerId(worker): ray.get_actor(name, namespace=namespace)
        for worker, name in sorted(names.items())
    }


def _named_workers(namespace: str) -> dict[str, str]:
    """worker id -> actor name of the named worker actors in `namespace` (live or
    restarting: Ray lists no dead ones)."""
    import ray.util

    found: dict[str, str] = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        match = _WORKER_NAME.fullmatch(entry["name"])
        if entry["namespace"] == namespace and match:
            found[match.group(1)] = entry["name"]
    return found


def stop_workers(actors: Mapping[WorkerId, Any], close_timeout_s: float = 60.0) -> None:
    """Close the workers (tiers and event streams flushed), then kill them: for the owner of
    the actors only, never for a router attached to another's workers."""
    import ray

    if actors:
        close_workers(actors, close_timeout_s)
    for actor in actors.values():
        ray.kill(actor)


def close_workers(actors: Mapping[WorkerId, Any], timeout_s: float) -> None:
    """Ask every worker to close (flush its tiers and event stream) and wait up to
    `timeout_s`; a worker that does not answer in time is only logged (it is killed next)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    refs = {worker: actor.close.remote() for worker, actor in actors.items()}
    _, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    for worker, ref in refs.items():
        try:
            if ref in pending:
                raise GetTimeoutError(f"no answer in {timeout_s:.0f} s")
            if not ray.get(ref):
                _log.warning("worker %s: its event stream was not flushed", worker)
        except RayError as exc:
            _log.warning("worker %s did not close cleanly: %s", worker, exc)
