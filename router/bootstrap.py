"""Assemble a Router over worker actors that already exist, and serve it until a signal.

The router process itself needs only the tokenizer and hashing: torch loads inside the worker
actors, never here. Starting, finding and stopping the workers is the application's job
(`cachesvc/app/serve.py`); the router is handed their handles.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import signal
import sys
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachesvc.kv.index import MemoryPrefixIndex, PrefixIndex
from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.core import Router
from router.grpc.server import RouterServer
from router.policy.routing import make_policy
from router.pool.events_source import make_event_source
from router.pool.supervisor import Replace
from router.pool.worker_pool import WorkerPool
from workers.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from router.http.server import HttpServer

_log = logging.getLogger(__name__)
STEP_TIMEOUT_S = 15.0  # each of the router's shutdown steps (its own grace is 5 s)
SHUTDOWN_REPORT_S = 45  # past this, a shutdown still running prints every thread's stack


def load_router_tokenizer(model: str | None) -> Tokenizer | None:
    """The model's tokenizer, as the workers load it; None for a folder that ships none."""
    from workers.text.default_model import default_model_path

    path = Path(model) if model is not None else default_model_path()
    if path.is_dir() and not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_path(path)


def make_index(config: RouterConfig) -> PrefixIndex:
    """The prefix index the config asks for: in Redis when `redis_url` is set, else in memory."""
    if config.redis_url is None:
        return MemoryPrefixIndex()
    from cachesvc.kv.index_redis import RedisPrefixIndex

    return RedisPrefixIndex.from_url(config.redis_url, config.redis_namespace)


async def build_router(
    actors: Mapping[WorkerId, Any],
    config: RouterConfig,
    model: str | None,
    replace: Replace | None = None,
) -> Router:
    """A started Router over existing worker actors: the workers have loaded their model and
    their cached blocks are indexed when this returns. `replace` starts a new actor for a
    worker that died for good (see `router.pool.supervisor`)."""
    policy = make_policy(config.policy, **config.policy_options())
    pool = WorkerPool(actors, make_index(config), config, make_event_source(config))
    router = Router(pool, load_router_tokenizer(model), policy, config, replace)
    await router.start()
    return router


async def serve_until_signal(router: Router, config: RouterConfig) -> None:
    """Serve until SIGINT or SIGTERM, then drain gracefully."""
    server = RouterServer(router, config)
    http = await _start_http(router, config)  # before gRPC starts: a taken port stops both
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
        # A shutdown that hangs says where: every thread's stack goes to stderr once it has
        # taken SHUTDOWN_REPORT_S (the owner's `run_serve` cancels the report when done).
        faulthandler.dump_traceback_later(SHUTDOWN_REPORT_S, exit=False)
        if http is not None:
            await _bounded("the HTTP door", http.stop())
        await _bounded("the gRPC server", server.stop())
        await _bounded("the router", router.close())


async def _bounded(what: str, step: Awaitable[None]) -> None:
    """One shutdown step, given up after STEP_TIMEOUT_S (logged): a step stuck on an
    unreachable store must not keep the process, and the workers it owns, from stopping."""
    try:
        await asyncio.wait_for(step, STEP_TIMEOUT_S)
    except TimeoutError:
        _log.warning("shutdown: %s did not stop in %.0f s; going on", what, STEP_TIMEOUT_S)


async def _start_http(router: Router, config: RouterConfig) -> HttpServer | None:
    """The OpenAI-compatible door, listening, when the config asks for one."""
    if config.http_port is None:
        return None
    from router.http.server import HttpServer

    name = config.served_model_name or "cachesvc"
    http = HttpServer(router, config, config.http_port, name)
    await http.start()
    scheme = "https" if http.tls else "http"
    print(
        f"cachesvc: OpenAI-compatible API on {scheme}://{config.host}:{http.port}/v1 "
        f"(model {name!r})",
        file=sys.stderr,
        flush=True,
    )
    return http
