"""System-test fixtures: one real local Ray cluster per session, a tiny random Llama with a real
(trained) BPE tokenizer, worker actors, and real gRPC routers on free loopback ports."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from local_ray import start_local_ray
from worker_support import spawn_one

from cachesvc.kv.types import WorkerId
from router.bootstrap import build_router
from router.config import RouterConfig
from router.core import Router
from router.grpc.server import RouterServer
from router.pool.supervisor import Replace
from workers.config import EngineConfig
from workers.model.tiny import BpeTokenizer, write_tiny_model

T = TypeVar("T")
VOCAB = 320
CONTEXT = 512
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A shared system prompt is cached once and reused by every request of its group.",
    "Routing sends each request to the worker that already holds its prefix.",
    "hello world, hello router, hello worker; the cache hit ratio goes up.",
] * 20


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (safetensors) with a tokenizer.json next to it."""
    tokenizer = BpeTokenizer(corpus=CORPUS, special=SPECIAL, eos="<|im_end|>")
    path = tmp_path_factory.mktemp("tiny-llama-tok")
    return write_tiny_model(
        path, vocab_size=VOCAB, max_position_embeddings=CONTEXT, tokenizer=tokenizer
    )


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256, num_threads=1)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    start_local_ray()
    yield
    ray.shutdown()


def spawn_pair(config: EngineConfig) -> dict[WorkerId, Any]:
    """Two worker actors (`worker_support.spawn_one`)."""
    return {WorkerId(f"worker-{i}"): spawn_one(config, f"worker-{i}") for i in range(2)}


def kill_all(actors: dict[WorkerId, Any]) -> None:
    import ray

    for actor in actors.values():
        ray.kill(actor)


class ServerThread:
    """A Router + grpc.aio server on their own event loop in a background thread."""

    def __init__(
        self,
        actors: dict[WorkerId, Any],
        config: RouterConfig,
        model: Path,
        replace: Replace | None = None,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.router, self.server = self.run(self._start(actors, config, str(model), replace))
        self.address = f"127.0.0.1:{self.server.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stop(self) -> None:
        if self.loop.is_closed():
            return  # stopped already (a test may stop a router to restart it)
        try:
            self.run(self._stop(), timeout=60)
        except TimeoutError:
            # Say what the router's loop is stuck on before failing.
            for task in asyncio.all_tasks(self.loop):
                task.print_stack()
            raise
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    @staticmethod
    async def _start(
        actors: dict[WorkerId, Any], config: RouterConfig, model: str, replace: Replace | None
    ) -> tuple[Router, RouterServer]:
        router = await build_router(actors, config, model, replace)
        server = RouterServer(router, config)
        await server.start()
        return router, server

    async def _stop(self) -> None:
        await self.server.stop(grace_s=1.0)
        await self.router.close()


@pytest.fixture(scope="module")
def worker_pair(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[WorkerId, Any]]:
    """Two fresh worker actors per test module (a module may kill them)."""
    actors = spawn_pair(engine_config)
    yield actors
    kill_all(actors)


ServerFactory = Callable[..., ServerThread]


@pytest.fixture(scope="module")
def make_server(worker_pair: dict[WorkerId, Any], tiny_model_dir: Path) -> Iterator[ServerFactory]:
    """Start routers over the module's workers: `make_server(policy=..., auth_token=...)`
    takes RouterConfig fields; every router is stopped at the end of the module."""
    servers: list[ServerThread] = []

    def start(**config: Any) -> ServerThread:
        config.setdefault("port", 0)
        # Tests of the KV cache and routing see every request reach a worker; the response
        # cache tests turn it on.
        config.setdefault("response_cache_mb", 0)
        server = ServerThread(worker_pair, RouterConfig(**config), tiny_model_dir)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def start_router(tiny_model_dir: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start routers over given actors: `start_router(actors, replace=None, **config)` takes
    RouterConfig fields; every router is stopped at the end of the test."""
    servers: list[ServerThread] = []

    def start(actors: dict[WorkerId, Any], replace: Replace | None = None, **config: Any) -> Any:
        config.setdefault("port", 0)
        # Tests of the KV cache and routing see every request reach a worker; the response
        # cache tests turn it on.
        config.setdefault("response_cache_mb", 0)
        server = ServerThread(actors, RouterConfig(**config), tiny_model_dir, replace)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
