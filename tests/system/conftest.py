"""System-test fixtures: one real local Ray cluster per session, a tiny random Llama with a real
(trained) BPE tokenizer, worker actors, and real gRPC routers on free loopback ports."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from cachesvc.config import EngineConfig
from cachesvc.types import WorkerId
from router.config import RouterConfig
from router.core import Router
from router.main import build_router
from router.server import RouterServer

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


def _write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= VOCAB
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "bos_token": None}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (safetensors) with a tokenizer.json next to it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path_factory.mktemp("tiny-llama-tok")
    LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=256, num_threads=1)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=128 * 2**20,
    )
    yield
    ray.shutdown()


def spawn_pair(config: EngineConfig) -> dict[WorkerId, Any]:
    """Two worker actors; half a CPU each so a second pair fits while one is torn down."""
    from workers.actor import spawn_worker

    return {
        WorkerId(f"worker-{i}"): spawn_worker(f"worker-{i}", config, num_cpus=0.5, max_restarts=0)
        for i in range(2)
    }


def kill_all(actors: dict[WorkerId, Any]) -> None:
    import ray

    for actor in actors.values():
        ray.kill(actor)


class ServerThread:
    """A Router + grpc.aio server on their own event loop in a background thread."""

    def __init__(self, actors: dict[WorkerId, Any], config: RouterConfig, model: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.router, self.server = self.run(self._start(actors, config, str(model)))
        self.address = f"127.0.0.1:{self.server.port}"

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stop(self) -> None:
        if self.loop.is_closed():
            return  # stopped already (a test may stop a router to restart it)
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    @staticmethod
    async def _start(
        actors: dict[WorkerId, Any], config: RouterConfig, model: str
    ) -> tuple[Router, RouterServer]:
        router = await build_router(actors, config, model)
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
        server = ServerThread(worker_pair, RouterConfig(**config), tiny_model_dir)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
