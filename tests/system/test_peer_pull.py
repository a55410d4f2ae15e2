"""Workers pull a prefix's blocks from each other over Ray: with a holder hint the chosen worker
computes only the rest and says the same greedy tokens; a holder that is gone, is killed while
serving, stalls or sends garbage costs a recompute, never an error; a tenant is never served
another tenant's blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cachesvc.config import EngineConfig, TierConfig
from workers.protocol import HolderHint, StreamDelta

pytestmark = pytest.mark.system

PARAMS = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
NUM_BLOCKS = 10  # full blocks of every prompt below (block size 4)
NS = "peer-pull-test"  # the workers' Ray namespace


def _prompt(seed: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 300 + 3 for j in range(NUM_BLOCKS * 4 + 2)]


def _generate(
    worker: Any, prompt: list[int], salt: str | None = None, holder: HolderHint | None = None
) -> tuple[list[int], StreamDelta]:
    import ray

    stream = worker.generate.options(num_returns="streaming").remote(
        prompt, PARAMS, uuid.uuid4().hex, salt, holder
    )
    tokens: list[int] = []
    last = None
    for ref in stream:
        last = ray.get(ref)
        assert isinstance(last, StreamDelta), last
        tokens.extend(last.token_ids)
    assert last is not None and last.usage is not None
    return tokens, last


@pytest.fixture(scope="module")
def pair(ray_cluster: None, engine_config: EngineConfig) -> Iterator[dict[str, Any]]:
    import ray

    from workers.actor import spawn_worker

    # A forced fetch: the tiny model computes a prompt faster than a pull's prior cost.
    tiers = TierConfig(plan="fetch", calibrate=False)
    config = dataclasses.replace(
        engine_config, peer_pull=True, peer_pull_timeout_s=2.0, tiers=tiers
    )
    names = {role: f"peer-{role}-{uuid.uuid4().hex[:6]}" for role in ("holder", "puller")}
    # In a namespace of their own, as `cachesvc serve` starts them: not the driver's.
    actors = {
        role: spawn_worker(role, config, name=name, namespace=NS, num_cpus=0.5, max_restarts=0)
        for role, name in names.items()
    }
    yield {**actors, "names": names}
    for actor in actors.values():
        ray.kill(actor)


def _stats(worker: Any) -> dict[str, int]:
    import ray

    stats: dict[str, int] = ray.get(worker.peer_stats.remote())
    return stats


def test_pulled_prefix_gives_the_same_tokens(pair: dict[str, Any]) -> None:
    import ray

    prompt = _prompt(1)
    expected, _ = _generate(pair["holder"], prompt, "tenant:a")
    hint = HolderHint(pair["names"]["holder"], NUM_BLOCKS)
    tokens, last = _generate(pair["puller"], prompt, "tenant:a", hint)
    assert tokens == expected
    assert last.usage is not None and last.usage.computed_tokens == len(prompt) - NUM_BLOCKS * 4
    assert _stats(pair["puller"])["pulled_blocks"] == NUM_BLOCKS
    # The holder reports what it sent: the chunk with the pulled blocks.
    sent = ray.get(pair["holder"].stats.remote()).tiering
    assert sent["peer_exported_chunks"] >= 1 and sent["peer_exported_bytes"] > 0


def test_another_tenant_is_not_served(pair: dict[str, Any]) -> None:
    prompt = _prompt(2)
    expected, _ = _generate(pair["holder"], prompt, "tenant:a")
    before = _stats(pair["puller"])["pulled_blocks"]
    hint = HolderHint(pair["names"]["holder"], NUM_BLOCKS)
    tokens, last = _generate(pair["puller"], prompt, "tenant:b", hint)
    assert tokens == expected  # the same model and prompt; nothing was shared
    assert last.usage is not None and last.usage.computed_tokens == len(prompt)
    assert _stats(pair["puller"])["pulled_blocks"] == before


def _fake_holder(kind: str) -> tuple[Any, str]:
    """A named actor that stalls on a pull, or answers it with blocks that do not verify.
    Its class is made here, so that Ray ships it by value (the test module is not importable
    in a worker)."""
    import ray

    class Stalls:
        async def ready(self) -> bool:
            return True

        async def export_chunk(self, *args: Any) -> None:
            await asyncio.sleep(120)

    class SendsGarbage(Stalls):
        async def export_chunk(
            self, prompt: list[int], salt: str | None, start: int, end: int
        ) -> Any:
            import numpy as np

            from workers.transfer.chunk import KVChunk

            rows = np.zeros((end - start, 4), dtype=np.float32)
            return KVChunk(start, "float32", rows, b"\x00" * 32)

    name = f"{kind}-{uuid.uuid4().hex[:6]}"
    cls = SendsGarbage if kind == "garbage" else Stalls
    options = {"name": name, "namespace": NS, "num_cpus": 0}
    actor = ray.remote(cls).options(**options).remote()  # type: ignore[attr-defined]
    ray.get(actor.ready.remote())
    return actor, name


@pytest.mark.parametrize("fault", ["gone", "stalls", "garbage"])
def test_faulty_holder_costs_a_recompute(pair: dict[str, Any], fault: str) -> None:
    import ray

    actor, name = None, "no-such-worker"
    if fault != "gone":
        actor, name = _fake_holder(fault)
    prompt = _prompt(10 + len(fault))
    expected, _ = _generate(pair["holder"], prompt)
    failures = _stats(pair["puller"])["pull_failures"]
    try:
        tokens, last = _generate(pair["puller"], prompt, None, HolderHint(name, NUM_BLOCKS))
    finally:
        if actor is not None:
            ray.kill(actor)
    assert tokens == expected
    assert last.usage is not None and last.usage.computed_tokens == len(prompt)
    # Garbage arrives and is a miss when it lands; the others never answer.
    assert _stats(pair["puller"])["pull_failures"] == failures + (fault != "garbage")


def test_holder_killed_while_serving_costs_a_recompute(pair: dict[str, Any]) -> None:
    import ray

    actor, name = _fake_holder("stalls")
    prompt = _prompt(20)
    expected, _ = _generate(pair["holder"], prompt)
    failures = _stats(pair["puller"])["pull_failures"]
    stream = (
        pair["puller"]
        .generate.options(num_returns="streaming")
        .remote(prompt, PARAMS, uuid.uuid4().hex, None, HolderHint(name, NUM_BLOCKS))
    )
    time.sleep(0.5)  # the pull is waiting on the holder
    ray.kill(actor)
    tokens = [t for ref in stream for t in ray.get(ref).token_ids]
    assert tokens == expected
    assert _stats(pair["puller"])["pull_failures"] == failures + 1


def test_router_passes_the_holder(
    pair: dict[str, Any], start_router: Any, caplog: pytest.LogCaptureFixture
) -> None:
    from cachesvc.types import WorkerId
    from router.domain import GenerateInput, PromptInput
    from workers.sampling_params import SamplingParams

    actors = {WorkerId(role): pair[role] for role in ("holder", "puller")}
    server = start_router(actors, policy="round_robin")
    prompt = _prompt(30)
    pulled = _stats(pair["puller"])["pulled_blocks"] + _stats(pair["holder"])["pulled_blocks"]

    async def ask() -> tuple[list[int], Any]:
        req = GenerateInput(
            uuid.uuid4().hex, PromptInput(token_ids=tuple(prompt)), SamplingParams(**PARAMS)
        )
        tokens: list[int] = []
        usage = None
        async for delta in server.router.generate(req):
            tokens.extend(delta.token_ids)
            usage = delta.usage or usage
        return tokens, usage

    first_tokens, first = server.run(ask())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="router.requests"):
        second_tokens, second = server.run(ask())
    assert second.worker_id != first.worker_id  # round robin: the other worker
    assert second_tokens == first_tokens
    assert second.computed_tokens == len(prompt) - NUM_BLOCKS * 4
    now = _stats(pair["puller"])["pulled_blocks"] + _stats(pair["holder"])["pulled_blocks"]
    assert now == pulled + NUM_BLOCKS
    assert second.cached_tokens == {"peer": NUM_BLOCKS * 4}
    assert server.router.metrics.pull_hints._value.get() >= 1
    # The request log says so (other routers of the session may log meanwhile: find ours).
    logged = [
        r.__dict__
        for r in caplog.records
        if r.name == "router.requests" and r.__dict__.get("worker") == second.worker_id
    ]
    assert any(
        "may pull 10 blocks" in r["route_reason"] and r["pulled_tokens"] == NUM_BLOCKS * 4
        for r in logged
    )
