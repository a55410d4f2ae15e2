"""`cachesvc serve`: connect to Ray, start the workers, route gRPC calls until a signal.

The router process itself needs only the tokenizer and hashing: torch loads inside the worker
actors, never here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.config import ConfigError, EngineConfig
from cachesvc.index import MemoryPrefixIndex, PrefixIndex
from cachesvc.types import WorkerId
from router.config import RouterConfig
from router.core import Router
from router.policy import make_policy
from router.pool import WorkerPool
from router.server import RouterServer
from workers.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServeConfig:
    """Everything `cachesvc serve` needs; `device="auto"` takes a GPU when the cluster has one."""

    engine: EngineConfig
    router: RouterConfig
    num_workers: int = 1
    ray_address: str | None = None
    num_cpus_per_worker: float = 1.0
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"--workers must be at least 1, got {self.num_workers}")
        if self.num_cpus_per_worker < 0:
            raise ConfigError("num_cpus_per_worker must be >= 0")


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
    pool = WorkerPool(actors, make_index(config), config)
    router = Router(pool, load_router_tokenizer(model), policy, config)
    await router.start()
    return router


def spawn_workers(config: ServeConfig) -> dict[WorkerId, Any]:
    """Start `num_workers` actors on the connected Ray cluster."""
    import ray

    from workers.actor import spawn_worker

    resources = ray.cluster_resources()
    engine, num_gpus = config.engine, 0.0
    wants_gpu = config.device == "cuda" or (
        config.device == "auto" and resources.get("GPU", 0) >= 1
    )
    if wants_gpu:
        engine, num_gpus = dataclasses.replace(engine, device="cuda"), 1.0
    # More workers than CPUs would wait forever for a CPU: share them instead.
    num_cpus = min(config.num_cpus_per_worker, resources.get("CPU", 1) / config.num_workers)
    return {
        WorkerId(f"worker-{i}"): spawn_worker(
            f"worker-{i}", engine, num_cpus=num_cpus, num_gpus=num_gpus
        )
        for i in range(config.num_workers)
    }


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
    ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
    actors: dict[WorkerId, Any] = {}
    try:
        actors = spawn_workers(config)

        async def main() -> int:
            try:
                router = await build_router(actors, config.router, config.engine.model)
            except Exception as exc:  # e.g. a worker that cannot load the model
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                print(f"cachesvc: error: workers failed to start: {first_line}", file=sys.stderr)
                return 1
            await serve_until_signal(router, config.router)
            return 0

        return asyncio.run(main())
    finally:
        for actor in actors.values():
            ray.kill(actor)
        ray.shutdown()
