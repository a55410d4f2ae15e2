"""`cachesvc serve`: connect to Ray, start the workers, route gRPC calls (and, with an HTTP
port, OpenAI-compatible HTTP requests) until a signal.

The workers (`workers/cluster.py`) are named in the Ray namespace `ray_namespace`, so a second
`cachesvc serve --attach` finds them and routes over them too. The owning serve closes them
(tiers flushed) and kills them on exit; an attached one leaves them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.kv.config import ConfigError
from cachesvc.kv.events_redis import EventStreamConfig
from cachesvc.kv.types import WorkerId
from router.bootstrap import build_router, make_index, serve_until_signal
from router.config import RouterConfig
from router.policy.routing import make_policy
from router.pool.supervisor import Replace
from workers.cluster import (
    Placement,
    WorkerGroup,
    find_workers,
    log_placement,
    replace_worker,
    spawn_workers,
    stop_workers,
)
from workers.config import EngineConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ServeConfig:
    """Everything `cachesvc serve` needs; `device="auto"` takes a GPU when the cluster has one.

    `attach` routes over the workers another serve started in `ray_namespace` (the engine
    fields and the worker counts are then not used, except `engine.model` for the tokenizer).
    `placement` lays the workers over the Ray cluster's nodes: "spread" (one node after
    another) or "any" (where Ray's default scheduler puts them).

    `num_workers` counts the mixed workers (prefill and decode both); None means one, or none
    when prefill or decode workers are asked for, so `--prefill-workers 1 --decode-workers 3`
    starts four workers, as a P/D operator expects (`num_mixed_workers`).
    """

    engine: EngineConfig
    router: RouterConfig
    num_workers: int | None = None
    ray_address: str | None = None
    num_cpus_per_worker: float = 1.0
    device: str = "auto"
    ray_namespace: str = "cachesvc"
    attach: bool = False
    close_timeout_s: float = 60.0
    placement: Placement = "spread"
    # Prefill and decode workers, besides the mixed ones (`EngineConfig.role`).
    num_prefill_workers: int = 0
    num_decode_workers: int = 0
    # A prefill worker's chunked-prefill chunk in tokens (None: the engine's step budget); a
    # smaller one lets decode workers pull a prompt's KV while the rest computes.
    prefill_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_worker_counts(self)
        if self.num_cpus_per_worker < 0:
            raise ConfigError("num_cpus_per_worker must be >= 0")
        if not self.ray_namespace.strip():
            raise ConfigError("--ray-namespace must not be empty")
        if self.close_timeout_s <= 0:
            raise ConfigError(f"close_timeout_s must be positive, got {self.close_timeout_s}")

    @property
    def num_mixed_workers(self) -> int:
        """The mixed workers to start: `num_workers`, or its default (1 without roles, 0 with)."""
        if self.num_workers is not None:
            return self.num_workers
        return 0 if self.num_prefill_workers or self.num_decode_workers else 1

    @property
    def num_all_workers(self) -> int:
        """Every worker this serve starts, whatever its role."""
        return self.num_prefill_workers + self.num_decode_workers + self.num_mixed_workers

    def worker_group(self) -> WorkerGroup:
        """The workers this serve starts; they publish their KV events to Redis when the
        router shares its index there. Raises a ConfigError naming the flag when the counts
        make no deployment (checked here, not at construction, for the flags alone may be
        incomplete: a config file gives the rest)."""
        _check_deployment(self)
        stream = None
        if self.router.redis_url is not None:
            stream = EventStreamConfig(self.router.redis_url, self.router.redis_namespace)
        engine = self.engine
        if self.router.pd_mixed:  # a hand-off between mixed workers is a pull between them
            engine = dataclasses.replace(engine, peer_pull=True)
        return WorkerGroup(
            engine,
            self.num_all_workers,
            self.ray_namespace,
            self.device,
            self.num_cpus_per_worker,
            stream,
            self.placement,
            num_prefill=self.num_prefill_workers,
            num_decode=self.num_decode_workers,
            prefill_chunk_tokens=self.prefill_chunk_tokens,
        )


def _check_worker_counts(config: ServeConfig) -> None:
    """Raise a ConfigError naming the flag for a negative count, or for roles without the
    router's peer pulls, by which decode workers get the prompts' KV."""
    counts = {
        "--workers": config.num_workers or 0,
        "--prefill-workers": config.num_prefill_workers,
        "--decode-workers": config.num_decode_workers,
    }
    for flag, count in counts.items():
        if count < 0:
            raise ConfigError(f"{flag} must be >= 0, got {count}")
    if (config.num_prefill_workers or config.num_decode_workers) and not config.router.peer_pull:
        raise ConfigError(
            "router.peer_pull must be true with prefill or decode workers: decode workers pull "
            "the KV of the prompts prefill workers computed"
        )
    if config.router.pd_mixed and not config.router.peer_pull:
        raise ConfigError(
            "router.peer_pull must be true with --pd-mixed: a mixed worker that decodes a "
            "handed-off request pulls the prompt's KV from the one that computed it"
        )


def _check_deployment(config: ServeConfig) -> None:
    """Raise a ConfigError naming the flag when the counts start no worker, or prompts with no
    worker to decode them (or the reverse)."""
    if config.num_all_workers < 1:
        raise ConfigError(
            "--workers must be at least 1 (or give --prefill-workers and --decode-workers)"
        )
    prefill, decode = config.num_prefill_workers, config.num_decode_workers
    if prefill and not decode and not config.num_mixed_workers:
        raise ConfigError(
            f"--prefill-workers {prefill} leaves no worker to decode on: add --decode-workers "
            "(or --workers for mixed ones)"
        )
    if decode and not prefill and not config.num_mixed_workers:
        raise ConfigError(
            f"--decode-workers {decode} leaves no worker to compute prompts: add "
            "--prefill-workers (or --workers for mixed ones)"
        )


def run_serve(config: ServeConfig) -> int:
    """Blocking entry point of `cachesvc serve`; returns the exit status."""
    import ray

    make_policy(config.router.policy)  # fail on a bad name before starting anything
    group = None if config.attach else config.worker_group()  # and on bad worker counts
    if config.router.redis_url is not None:
        make_index(config.router)  # and on an unreachable Redis (ConnectionError)
    ray.init(
        address=config.ray_address,
        namespace=config.ray_namespace,
        include_dashboard=False,
        log_to_driver=True,
    )
    owned: dict[WorkerId, Any] = {}  # the workers this serve started: closed and killed
    replace: Replace | None = None
    try:
        if group is None:
            actors = find_workers(config.ray_namespace, config.ray_address)
        else:
            actors = owned = spawn_workers(group)

            def replace(worker: WorkerId) -> Any:
                # A worker dead for good gets a new actor, owned (and stopped) like the first.
                owned[worker] = replace_worker(group, worker)
                return owned[worker]

        return asyncio.run(_route(actors, config, replace))
    finally:
        stop_workers(owned, config.close_timeout_s)
        ray.shutdown()
        faulthandler.cancel_dump_traceback_later()  # armed when shutdown began


def served_model_name(model: str | None) -> str:
    """What the HTTP door calls the model of `--model`: the file or folder name without a
    `.gguf` suffix; None (the default model) is SmolLM2-135M-Instruct."""
    if model is None:
        return DEFAULT_MODEL_NAME
    name = Path(model.rstrip("/")).name or model
    return name.removesuffix(".gguf")


async def _route(
    actors: Mapping[WorkerId, Any], config: ServeConfig, replace: Replace | None
) -> int:
    router_config = config.router
    if router_config.http_port is not None and router_config.served_model_name is None:
        name = served_model_name(config.engine.model)
        router_config = dataclasses.replace(router_config, served_model_name=name)
    try:
        router = await build_router(actors, router_config, config.engine.model, replace)
    except Exception as exc:  # e.g. a worker that cannot load the model
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        print(f"cachesvc: error: workers failed to start: {first_line}", file=sys.stderr)
        return 1
    await log_placement(actors)  # where each worker landed: they have all started by now
    await serve_until_signal(router, router_config)
    return 0
