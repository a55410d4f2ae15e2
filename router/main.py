"""`cachesvc serve`: connect to Ray, start the workers, route gRPC calls until a signal.

The router process itself needs only the tokenizer and hashing: torch loads inside the worker
actors, never here.

Workers are named `cachesvc-worker-<i>` in the Ray namespace `ray_namespace`, so a second
`cachesvc serve --attach` finds them and routes over them too. They are not detached actors:
named actors are visible to every job of the cluster while their owner lives, and tying their
lifetime to the serve that started them means a crashed serve never leaves workers holding GPUs.
The owning serve closes them (tiers flushed) and kills them on exit; an attached one leaves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.config import ConfigError, EngineConfig
from cachesvc.events_redis import EventStreamConfig
from cachesvc.index import MemoryPrefixIndex, PrefixIndex
from cachesvc.types import WorkerId
from router.config import RouterConfig
from router.core import Router
from router.events_source import make_event_source
from router.policy import make_policy
from router.pool import WorkerPool
from router.server import RouterServer
from workers.model.tokenizer import Tokenizer

_log = logging.getLogger(__name__)
_WORKER_NAME = re.compile(r"cachesvc-(worker-\d+)")


@dataclass(frozen=True)
class ServeConfig:
    """Everything `cachesvc serve` needs; `device="auto"` takes a GPU when the cluster has one.

    `attach` routes over the workers another serve started in `ray_namespace` (the engine
    fields and `num_workers` are then not used, except `engine.model` for the tokenizer).
    """

    engine: EngineConfig
    router: RouterConfig
    num_workers: int = 1
    ray_address: str | None = None
    num_cpus_per_worker: float = 1.0
    device: str = "auto"
    ray_namespace: str = "cachesvc"
    attach: bool = False
    close_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.num_workers}")
        if self.num_cpus_per_worker < 0:
            raise ConfigError("num_cpus_per_worker must be >= 0")
        if not self.ray_namespace.strip():
            raise ConfigError("--ray-namespace must not be empty")
        if self.close_timeout_s <= 0:
            raise ConfigError(f"close_timeout_s must be positive, got {self.close_timeout_s}")


class AttachError(ConfigError):
    """No workers to attach to, or workers already running where new ones would start."""


def load_router_tokenizer(model: str | None) -> Tokenizer | None:
    """The model's tokenizer, as the workers load it; None for a folder that ships none."""
    from workers.model.default_model import default_model_path

    path = Path(model) if model is not None else default_model_path()
    if path.is_dir() and not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_path(path)


def make_index(config: RouterConfig) -> PrefixIndex:
    """The prefix index the config asks for: in Redis when `redis_url` is set, else in memory."""
    if config.redis_url is None:
        return MemoryPrefixIndex()
    from cachesvc.index_redis import RedisPrefixIndex

    return RedisPrefixIndex.from_url(config.redis_url, config.redis_namespace)


async def build_router(
    actors: Mapping[WorkerId, Any], config: RouterConfig, model: str | None
) -> Router:
    """A started Router over existing worker actors: the workers have loaded their model and
    their cached blocks are indexed when this returns."""
    policy = make_policy(
        config.policy,
        abs_threshold=config.balance_abs_threshold,
        rel_threshold=config.balance_rel_threshold,
    )
    pool = WorkerPool(actors, make_index(config), config, make_event_source(config))
    router = Router(pool, load_router_tokenizer(model), policy, config)
    await router.start()
    return router


def spawn_workers(config: ServeConfig) -> dict[WorkerId, Any]:
    """Start `num_workers` named actors on the connected Ray cluster, in `ray_namespace`;
    they publish their KV events to Redis when the router shares its index there.
    Raises AttachError when workers of this namespace are already running."""
    import ray

    from workers.actor import spawn_worker

    running = _named_workers(config.ray_namespace)
    if running:
        raise AttachError(
            f"cachesvc workers are already running in Ray namespace {config.ray_namespace!r} "
            f"({', '.join(sorted(running))}): route over them with `cachesvc serve --attach`, "
            "or start new ones under another --ray-namespace"
        )
    resources = ray.cluster_resources()
    engine, num_gpus = config.engine, 0.0
    wants_gpu = config.device == "cuda" or (
        config.device == "auto" and resources.get("GPU", 0) >= 1
    )
    if wants_gpu:
        engine, num_gpus = dataclasses.replace(engine, device="cuda"), 1.0
    # More workers than CPUs would wait forever for a CPU: share them instead.
    num_cpus = min(config.num_cpus_per_worker, resources.get("CPU", 1) / config.num_workers)
    stream = None
    if config.router.redis_url is not None:
        stream = EventStreamConfig(config.router.redis_url, config.router.redis_namespace)
    return {
        WorkerId(f"worker-{i}"): spawn_worker(
            f"worker-{i}",
            engine,
            name=f"cachesvc-worker-{i}",
            namespace=config.ray_namespace,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            event_stream=stream,
        )
        for i in range(config.num_workers)
    }


def find_workers(config: ServeConfig) -> dict[WorkerId, Any]:
    """Handles of the live workers another serve started in `ray_namespace` (for
    `--attach`); raises AttachError when there are none."""
    import ray

    names = _named_workers(config.ray_namespace)
    if not names:
        address = config.ray_address or "a new local Ray cluster (pass --ray-address)"
        raise AttachError(
            f"no cachesvc workers in Ray namespace {config.ray_namespace!r} at {address}: "
            "start `cachesvc serve` there first"
        )
    return {
        WorkerId(worker): ray.get_actor(name, namespace=config.ray_namespace)
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


async def serve_until_signal(router: Router, config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain gracefully."""
    server = RouterServer(router, config)
    await server.start()
    print(
        f"cachesvc: serving on {config.host}:{server.port} (policy {router.policy.name}, "
        f"{len(router.pool.states())} workers); Ctrl-C stops",
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        print("cachesvc: shutting down", file=sys.stderr, flush=True)
        await server.stop()
        await router.close()


def run_serve(config: ServeConfig) -> int:
    """Blocking entry point of `cachesvc serve`; returns the exit status."""
    import ray

    make_policy(config.router.policy)  # fail on a bad name before starting anything
    if config.router.redis_url is not None:
        make_index(config.router)  # and on an unreachable Redis (ConnectionError)
    ray.init(
        address=config.ray_address,
        namespace=config.ray_namespace,
        include_dashboard=False,
        log_to_driver=True,
    )
    owned: dict[WorkerId, Any] = {}  # the workers this serve started: closed and killed
    try:
        if config.attach:
            actors = find_workers(config)
        else:
            actors = owned = spawn_workers(config)
        return asyncio.run(_route(actors, config))
    finally:
        stop_workers(owned, config.close_timeout_s)
        ray.shutdown()


async def _route(actors: Mapping[WorkerId, Any], config: ServeConfig) -> int:
    try:
        router = await build_router(actors, config.router, config.engine.model)
    except Exception as exc:  # e.g. a worker that cannot load the model
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        print(f"cachesvc: error: workers failed to start: {first_line}", file=sys.stderr)
        return 1
    await serve_until_signal(router, config.router)
    return 0
