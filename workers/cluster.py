"""A group of worker actors on a Ray cluster: start them, find them, close and stop them.

Workers are named `cachesvc-worker-<i>` in a Ray namespace, so a second router finds them
(`find_workers`). They are not detached actors: named actors are visible to every job of the
cluster while their owner lives, and tying their lifetime to the process that started them
means a crashed owner never leaves workers holding GPUs. Ray is imported inside each function.

On a cluster of several nodes the workers are spread over the nodes by default (Ray's SPREAD
strategy, among the nodes that have what a worker asks for: with GPUs, the GPU nodes only), so
a node that leaves takes as few workers as possible with it and every node's memory and disk
hold a tier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from cachesvc.kv.config import ConfigError
from cachesvc.kv.events_redis import EventStreamConfig
from cachesvc.kv.types import WorkerId
from workers.config import EngineConfig
from workers.protocol import WorkerInfo

_log = logging.getLogger(__name__)
_WORKER_NAME = re.compile(r"cachesvc-(worker-\d+)")
_WORKER_INDEX = re.compile(r"worker-(\d+)")

# "spread": one node after another (Ray's SPREAD strategy); "any": wherever Ray's default
# scheduler puts them (it favours the node the router runs on and nodes already busy).
Placement = Literal["spread", "any"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
_RAY_STRATEGY = {"spread": "SPREAD", "any": "DEFAULT"}


# A prefill worker stages a handed-off prompt's KV at its next step boundary, and its steps are
# long prefills (seconds each on a CPU): a decode worker waits for one rather than recompute the
# prompt, which would stall every stream it decodes for as long. A holder that is gone fails the
# pull at once; one that is frozen costs this wait, then the recompute.
DECODE_PULL_TIMEOUT_S = 30.0


class AttachError(ConfigError):
    """No workers to attach to, or workers already running where new ones would start."""


@dataclass(frozen=True)
class WorkerGroup:
    """How a group of workers runs; `device="auto"` takes a GPU when the cluster has one, and
    with `event_stream` the workers publish their KV events to Redis. `placement` says how the
    workers are laid over the cluster's nodes (`PLACEMENTS`).

    Of the `num_workers`, the first `num_prefill` are prefill workers, the next `num_decode`
    decode workers and the rest mixed (`role_of`; `EngineConfig.role` says what a role means).
    """

    engine: EngineConfig
    num_workers: int = 1
    namespace: str = "cachesvc"
    device: str = "auto"
    num_cpus_per_worker: float = 1.0
    event_stream: EventStreamConfig | None = None
    placement: Placement = "spread"
    num_prefill: int = 0
    num_decode: int = 0
    # A prefill worker's step budget (its chunked-prefill chunk), when not the engine's: a
    # smaller chunk lets a decode worker pull a prompt's KV while the rest of it computes.
    prefill_chunk_tokens: int | None = None
    # Requests a worker holds (running or waiting) before it refuses more (RESOURCE_EXHAUSTED).
    max_queued_requests: int = 256

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise ConfigError(
                f"prefill_chunk_tokens must be positive, got {self.prefill_chunk_tokens}"
            )
        if self.num_prefill < 0 or self.num_decode < 0:
            raise ConfigError(
                f"num_prefill and num_decode must be >= 0, got {self.num_prefill} and "
                f"{self.num_decode}"
            )
        if self.num_prefill + self.num_decode > self.num_workers:
            raise ConfigError(
                f"num_prefill + num_decode ({self.num_prefill} + {self.num_decode}) must not "
                f"exceed num_workers ({self.num_workers})"
            )

    @property
    def uses_roles(self) -> bool:
        """Whether any worker of the group is a prefill or a decode worker."""
        return self.num_prefill + self.num_decode > 0

    def role_of(self, index: int) -> str:
        """The role of worker `index` (0-based): prefill workers first, then decode, then
        mixed. Pure."""
        if not 0 <= index < self.num_workers:
            raise IndexError(f"worker index {index} out of range for {self.num_workers} workers")
        if index < self.num_prefill:
            return "prefill"
        if index < self.num_prefill + self.num_decode:
            return "decode"
        return "mixed"

    def engine_of(self, index: int, engine: EngineConfig) -> EngineConfig:
        """`engine` (the group's, as `worker_resources` adapted it) for worker `index`: its
        role, and peer pulls on in a group with roles, for decode workers pull the KV that
        prefill workers computed (and any worker may be asked for a prefix it lacks). A decode
        worker waits at least `DECODE_PULL_TIMEOUT_S` for a pull; a prefill worker steps
        `prefill_chunk_tokens` at most, when set. Pure."""
        role = self.role_of(index)
        timeout_s = engine.peer_pull_timeout_s
        if role == "decode":
            timeout_s = max(timeout_s, DECODE_PULL_TIMEOUT_S)
        budget = engine.max_num_batched_tokens
        if role == "prefill" and self.prefill_chunk_tokens is not None:
            budget = self.prefill_chunk_tokens
        return dataclasses.replace(
            engine,
            role=role,
            peer_pull=engine.peer_pull or self.uses_roles,
            peer_pull_timeout_s=timeout_s,
            max_num_batched_tokens=budget,
        )


@dataclass(frozen=True)
class WorkerResources:
    """What each worker of a group asks Ray for, and the engine config it runs."""

    engine: EngineConfig
    num_cpus: float
    num_gpus: float
    scheduling_strategy: str  # Ray's name of the strategy: "SPREAD" or "DEFAULT"
    # Custom Ray resources each role's workers ask for (`role_resource`), by role; a role the
    # cluster has no nodes for asks for none.
    role_resources: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def resources_of(self, role: str) -> dict[str, float]:
        """The custom Ray resources a worker of `role` asks for (empty: none)."""
        return dict(self.role_resources.get(role, {}))


def role_resource(role: str) -> str:
    """The custom Ray resource a node started for workers of `role` offers, one unit per
    worker it takes: the Helm chart starts each role's worker pods with it, so each worker
    lands on a pod sized for its role."""
    return f"cachesvc_role_{role}"


def worker_resources(group: WorkerGroup, cluster: Mapping[str, float]) -> WorkerResources:
    """What each worker of `group` asks for on a cluster of `cluster` resources (as
    `ray.cluster_resources()` counts them, over every node). Pure.

    `device="auto"` takes a GPU per worker as soon as the cluster has one: Ray then places the
    workers on GPU nodes only, and a worker for which no GPU is free waits for one (an
    autoscaler may add a node) rather than running on a CPU beside GPU workers."""
    engine, num_gpus = group.engine, 0.0
    wants_gpu = group.device == "cuda" or (group.device == "auto" and cluster.get("GPU", 0) >= 1)
    if wants_gpu:
        engine, num_gpus = dataclasses.replace(engine, device="cuda"), 1.0
    # More workers than CPUs would wait forever for a CPU: share them instead.
    num_cpus = min(group.num_cpus_per_worker, cluster.get("CPU", 1) / group.num_workers)
    roles = {group.role_of(i) for i in range(group.num_workers)}
    tagged = {
        role: {role_resource(role): 1.0} for role in roles if cluster.get(role_resource(role), 0)
    }
    return WorkerResources(engine, num_cpus, num_gpus, _RAY_STRATEGY[group.placement], tagged)


def spawn_workers(group: WorkerGroup) -> dict[WorkerId, Any]:
    """Start `num_workers` named actors on the connected Ray cluster, in `namespace`; returns
    their handles without waiting for the models to load. Raises AttachError when workers of
    this namespace are already running."""

    from workers.spawn import spawn_worker

    running = _named_workers(group.namespace)
    if running:
        raise AttachError(
            f"cachesvc workers are already running in Ray namespace {group.namespace!r} "
            f"({', '.join(sorted(running))}): route over them with `cachesvc serve --attach`, "
            "or start new ones under another --ray-namespace"
        )
    asks = _resources(group)
    return {
        WorkerId(f"worker-{i}"): spawn_worker(
            f"worker-{i}",
            group.engine_of(i, asks.engine),
            name=f"cachesvc-worker-{i}",
            namespace=group.namespace,
            num_cpus=asks.num_cpus,
            num_gpus=asks.num_gpus,
            resources=asks.resources_of(group.role_of(i)),
            event_stream=group.event_stream,
            scheduling_strategy=asks.scheduling_strategy,
            max_queued_requests=group.max_queued_requests,
        )
        for i in range(group.num_workers)
    }


def replace_worker(group: WorkerGroup, worker: WorkerId, name_wait_s: float = 10.0) -> Any:
    """Start a new actor for `worker` of a group `spawn_workers` started (under the same
    name, once the old actor is gone: it is killed first) and return its handle; the new
    actor keeps the old one's role. Blocks until Ray has taken the name; raises ValueError when
    it is still taken after `name_wait_s`."""
    import ray

    from workers.spawn import spawn_worker

    name = f"cachesvc-{worker}"
    asks = _resources(group)
    index = worker_index(worker)
    engine = group.engine_of(index, asks.engine)
    with contextlib.suppress(ValueError):  # no actor of that name: it is gone already
        ray.kill(ray.get_actor(name, namespace=group.namespace), no_restart=True)
    deadline = time.monotonic() + name_wait_s
    while True:
        try:
            return spawn_worker(
                worker,
                engine,
                name=name,
                namespace=group.namespace,
                num_cpus=asks.num_cpus,
                num_gpus=asks.num_gpus,
                resources=asks.resources_of(group.role_of(index)),
                event_stream=group.event_stream,
                scheduling_strategy=asks.scheduling_strategy,
                max_queued_requests=group.max_queued_requests,
            )
        except ValueError:  # the dead actor's name is released a moment after its death
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def worker_index(worker: WorkerId) -> int:
    """The index `spawn_workers` gave `worker` ("worker-3" -> 3); ValueError for an id it
    did not make. Pure."""
    match = _WORKER_INDEX.fullmatch(worker)
    if match is None:
        raise ValueError(f"{worker!r} is not a worker id spawn_workers made (worker-<index>)")
    return int(match.group(1))


def _resources(group: WorkerGroup) -> WorkerResources:
    """`worker_resources` on the connected cluster; warns when GPU workers outnumber its GPUs."""
    import ray

    cluster = ray.cluster_resources()
    asks = worker_resources(group, cluster)
    num_gpus = cluster.get("GPU", 0)
    if asks.num_gpus and num_gpus < group.num_workers:
        _log.warning(
            "%d workers each take a GPU, the Ray cluster has %g: the others wait for a GPU "
            "node to join (or pass --device cpu)",
            group.num_workers,
            num_gpus,
        )
    return asks


def placement_report(infos: Mapping[WorkerId, WorkerInfo | None]) -> list[str]:
    """One line per worker saying which Ray node it runs on (None: it did not say) and its
    role unless mixed, then how many nodes they span: what an operator reads to see where the
    workers landed. Pure."""
    lines = [
        f"{worker}{_role_tag(info)} runs on node {_node_name(info)}"
        for worker, info in sorted(infos.items())
    ]
    nodes = Counter(info.node_id for info in infos.values() if info is not None)
    per_node = " + ".join(str(n) for n in sorted(nodes.values(), reverse=True))
    lines.append(f"{sum(nodes.values())} workers on {len(nodes)} Ray nodes ({per_node})")
    return lines


def _role_tag(info: WorkerInfo | None) -> str:
    # Mixed is the default and says nothing: a deployment without roles reads as before.
    return "" if info is None or info.role == "mixed" else f" ({info.role})"


def _node_name(info: WorkerInfo | None) -> str:
    if info is None or info.node_id is None:
        return "unknown"
    return f"{info.node_id[:12]} at {info.node_ip} ({info.device})"


async def log_placement(actors: Mapping[WorkerId, Any], timeout_s: float = 10.0) -> None:
    """Log `placement_report` of the workers (asks each for its info: call it once they have
    started). A worker that does not answer within `timeout_s` is logged as on an unknown
    node, never raised: the report is for the operator only."""
    import asyncio

    answers = await asyncio.gather(
        *(asyncio.wait_for(actor.info.remote(), timeout_s) for actor in actors.values()),
        return_exceptions=True,
    )
    infos = {
        worker: answer if isinstance(answer, WorkerInfo) else None
        for worker, answer in zip(actors, answers, strict=True)
    }
    for line in placement_report(infos):
        _log.info("%s", line)


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
