"""Workers pull a prefix's blocks from each other over Ray: with a holder hint the chosen worker
computes only the rest and says the same greedy tokens; on one node the chunks come through the
holder's shared-memory slots, which go back to it once the puller landed them (or died), and a
holder without slots sends through the object store with the same tokens; a holder that is
gone, is killed while serving, stalls or sends garbage costs a recompute, never an error; a
tenant is never served another tenant's blocks."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from cachesvc.kv.config import TierConfig
from workers.config import EngineConfig
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

    from workers.spawn import spawn_worker

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
            self, prompt: Any, salt: str | None, start: int, end: int, *puller: Any
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
    from cachesvc.kv.types import WorkerId
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


def _sent(holder: Any) -> dict[str, float]:
    """What a holder reports it sent (`ChunkExporter.counters`), its slots' state included."""
    import ray

    tiering: dict[str, float] = ray.get(holder.stats.remote()).tiering
    return tiering


def _until(holder: Any, done: Any) -> dict[str, float]:
    """The holder's counters once `done(counters)` holds (a release lands a moment after the
    stream ends); the last ones seen after a minute."""
    deadline = time.monotonic() + 60
    sent = _sent(holder)
    while not done(sent) and time.monotonic() < deadline:
        time.sleep(0.05)
        sent = _sent(holder)
    return sent


def _pull_through_a_slot(pair: dict[str, Any], prompt: list[int]) -> list[int]:
    """Pull `prompt`'s blocks into the puller until one pull came through a slot: the holder
    makes its slots on a thread when it first needs them, so a first pull may go through the
    object store. Returns the pulled tokens; every pull must give them."""
    import ray

    hint = HolderHint(pair["names"]["holder"], NUM_BLOCKS)
    local = _sent(pair["holder"]).get("peer_exported_local_chunks", 0.0)
    for _ in range(10):
        ray.get(pair["puller"].flush.remote())  # so that it pulls again
        tokens, last = _generate(pair["puller"], prompt, None, hint)
        assert last.usage is not None and last.usage.cached_tokens == {"peer": NUM_BLOCKS * 4}
        if _sent(pair["holder"])["peer_exported_local_chunks"] > local:
            return tokens
    raise AssertionError(f"no pull came through a slot: {_sent(pair['holder'])}")


def test_a_same_node_pull_reads_the_holders_slot_and_gives_it_back(
    pair: dict[str, Any],
) -> None:
    prompt = _prompt(40)
    expected, _ = _generate(pair["holder"], prompt)
    assert _pull_through_a_slot(pair, prompt) == expected
    # Landed at the puller's step, the blocks' views are gone and the lease with them.
    sent = _until(pair["holder"], lambda s: s["peer_slots_leased"] == 0)
    assert sent["peer_slots_leased"] == 0 and sent["peer_slots"] >= 1


def test_a_killed_puller_leaks_no_slot(pair: dict[str, Any]) -> None:
    import ray

    class Hoarder:
        """Pulls chunks over a worker's link and keeps them (their slots leased) until killed.
        Made here, so that Ray ships it by value."""

        def __init__(self) -> None:
            from workers.transfer.ray_link import RayPeerLink

            self.link = RayPeerLink(NS)
            self.kept: list[Any] = []

        def pull(self, holder: str, prompt: list[int], num_blocks: int) -> int:
            ask = [(0, num_blocks)]
            chunks = list(self.link.fetch(holder, prompt, None, ask, time.monotonic() + 60))
            self.kept.extend(chunks)
            return sum(c.num_blocks for c in chunks)

    prompt = _prompt(41)
    _generate(pair["holder"], prompt)
    hoarder = ray.remote(Hoarder).options(namespace=NS, num_cpus=0).remote()  # type: ignore[attr-defined]
    reclaimed = _sent(pair["holder"])["peer_slots_reclaimed"]
    try:
        for _ in range(10):  # until a chunk came through a slot (the first may not)
            assert ray.get(hoarder.pull.remote(pair["names"]["holder"], prompt, NUM_BLOCKS)) > 0
            if _sent(pair["holder"])["peer_slots_leased"] >= 1:
                break
        assert _sent(pair["holder"])["peer_slots_leased"] >= 1
    finally:
        ray.kill(hoarder)
    sent = _until(pair["holder"], lambda s: s["peer_slots_leased"] == 0)
    assert sent["peer_slots_leased"] == 0
    assert sent["peer_slots_reclaimed"] > reclaimed


def test_a_holder_without_slots_sends_through_the_object_store(
    pair: dict[str, Any], engine_config: EngineConfig
) -> None:
    import ray

    from workers.spawn import spawn_worker

    config = dataclasses.replace(
        engine_config, peer_shm_mb=0, tiers=TierConfig(plan="fetch", calibrate=False)
    )
    name = f"peer-plain-{uuid.uuid4().hex[:6]}"
    plain = spawn_worker("plain", config, name=name, namespace=NS, num_cpus=0.5, max_restarts=0)
    try:
        prompt = _prompt(42)
        expected, _ = _generate(plain, prompt)
        tokens, last = _generate(pair["puller"], prompt, None, HolderHint(name, NUM_BLOCKS))
        sent = _sent(plain)
    finally:
        ray.kill(plain)
    assert tokens == expected
    assert last.usage is not None and last.usage.cached_tokens == {"peer": NUM_BLOCKS * 4}
    assert sent["peer_exported_chunks"] >= 1 and sent["peer_exported_local_chunks"] == 0
    assert sent["peer_slots"] == 0


def test_a_held_prefill_is_served_from_its_pins_then_let_go(pair: dict[str, Any]) -> None:
    """A hand-off's prefill (`hold_kv`) keeps its blocks pinned for the pull that follows: the
    pull is served from those pins (no step boundary awaited), they go back once sent, and a
    later pull of the same prompt pins the usual way with the same tokens."""
    import ray

    prompt = _prompt(50)
    generate = pair["holder"].generate.options(num_returns="streaming")
    stream = generate.remote(prompt, PARAMS, uuid.uuid4().hex, None, None, hold_kv=True)
    expected = [t for ref in stream for t in ray.get(ref).token_ids]
    held = _sent(pair["holder"])
    assert held["peer_held_blocks"] == NUM_BLOCKS  # pinned from the step that computed them
    hint = HolderHint(pair["names"]["holder"], NUM_BLOCKS)
    tokens, last = _generate(pair["puller"], prompt, None, hint)
    assert tokens == expected
    assert last.usage is not None and last.usage.cached_tokens == {"peer": NUM_BLOCKS * 4}
    sent = _until(pair["holder"], lambda s: s["peer_held_blocks"] == 0)
    assert sent["peer_held_blocks"] == 0
    assert sent["peer_held_chunks"] > held["peer_held_chunks"]

    ray.get(pair["puller"].flush.remote())
    again, last = _generate(pair["puller"], prompt, None, hint)
    assert again == expected and last.usage is not None
    assert last.usage.cached_tokens == {"peer": NUM_BLOCKS * 4}
    assert _sent(pair["holder"])["peer_held_chunks"] == sent["peer_held_chunks"]
