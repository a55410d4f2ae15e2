"""Workers on two Ray nodes: a prefix pulled from a worker on another node gives the same greedy
tokens as computing it; the holder's node removed while the puller pulls costs a recompute,
never a wrong token or a failed request; the serving worker's node removed mid-stream fails
over as a worker death does, the client's one stream ending with the same tokens."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from multinode_support import FREEZE, KILL, RayNodes, node_of, pid_of, signal_pid

from cachesvc.kv.config import TierConfig
from cachesvc.kv.types import WorkerId
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig
from workers.protocol import HolderHint, StreamDelta

pytestmark = pytest.mark.system
NUM_BLOCKS = 10  # full blocks of every prompt below (block size 4)
NS = "multinode-test"  # the workers' Ray namespace, as `cachesvc serve` names its own


def _prompt(seed: int) -> list[int]:
    return [(seed * 37 + 11 * j) % 300 + 3 for j in range(NUM_BLOCKS * 4 + 2)]


def _request(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def _tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


@pytest.fixture(scope="module")
def pull_config(engine_config: EngineConfig) -> EngineConfig:
    # A forced fetch: the tiny model computes a prompt faster than a pull's prior cost. The
    # pull's timeout is long: what ends a pull below is the node's loss, not the clock.
    tiers = TierConfig(plan="fetch", calibrate=False)
    return dataclasses.replace(engine_config, peer_pull=True, peer_pull_timeout_s=30.0, tiers=tiers)


@pytest.fixture
def two_nodes(ray_nodes: RayNodes) -> Iterator[tuple[Any, Any]]:
    """Two fresh worker nodes of one CPU each (a test may remove them)."""
    nodes = (ray_nodes.add(), ray_nodes.add())
    yield nodes
    for node in nodes:
        ray_nodes.remove(node)


def _spawn_on(node: Any, worker: str, config: EngineConfig) -> tuple[Any, str]:
    """A worker actor on `node` and nowhere else (no restarts: its node's loss is its death);
    returns its handle and its actor name."""
    from workers.spawn import spawn_worker

    name = f"cachesvc-{worker}-{uuid.uuid4().hex[:6]}"
    actor = spawn_worker(
        worker,
        config,
        name=name,
        namespace=NS,
        num_cpus=1,
        max_restarts=0,
        scheduling_strategy=RayNodes.pin(node),
    )
    return actor, name


def _pair(nodes: tuple[Any, Any], config: EngineConfig) -> dict[WorkerId, tuple[Any, str]]:
    return {
        WorkerId(f"worker-{i}"): _spawn_on(node, f"worker-{i}", config)
        for i, node in enumerate(nodes)
    }


def test_a_pull_across_nodes_gives_the_same_tokens(
    two_nodes: tuple[Any, Any], pull_config: EngineConfig, start_router: Any
) -> None:
    pair = _pair(two_nodes, pull_config)
    actors = {worker: actor for worker, (actor, _) in pair.items()}
    assert node_of(actors[WorkerId("worker-0")]) != node_of(actors[WorkerId("worker-1")])
    server = start_router(actors, policy="round_robin")
    stub = pb_grpc.InferenceStub(server.channel())
    prompt = _prompt(1)

    computed = list(stub.Generate(_request(prompt, 8), timeout=120))
    pulled = list(stub.Generate(_request(prompt, 8), timeout=120))

    first, second = computed[-1].usage, pulled[-1].usage
    assert second.worker_id != first.worker_id  # round robin: the other node's worker
    assert first.computed_tokens == len(prompt)
    assert _tokens(pulled) == _tokens(computed)
    # What the second worker did not compute came from the first one, across the nodes.
    assert dict(second.cached_tokens) == {"peer": NUM_BLOCKS * 4}
    assert second.computed_tokens == len(prompt) - NUM_BLOCKS * 4
    # Through the object store, however often: a holder's shared-memory slots are for its own
    # node's pullers (the first pull never finds one: the ring makes them when first asked).
    import ray

    holder, holder_name = pair[WorkerId(first.worker_id)]
    puller = actors[WorkerId(second.worker_id)]
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    for _ in range(3):
        ray.get(puller.flush.remote(), timeout=60)
        stream = puller.generate.options(num_returns="streaming").remote(
            prompt, params, uuid.uuid4().hex, None, HolderHint(holder_name, NUM_BLOCKS)
        )
        deltas = [ray.get(ref, timeout=120) for ref in stream]
        assert [t for d in deltas for t in d.token_ids] == _tokens(pulled)
        assert deltas[-1].usage.cached_tokens == {"peer": NUM_BLOCKS * 4}
    sent = ray.get(holder.stats.remote(), timeout=60).tiering
    assert sent["peer_exported_chunks"] >= 4 and sent["peer_exported_local_chunks"] == 0


def test_the_holders_node_removed_mid_pull_costs_a_recompute(
    ray_nodes: RayNodes, two_nodes: tuple[Any, Any], pull_config: EngineConfig
) -> None:
    import ray

    holder_node, puller_node = two_nodes
    holder, holder_name = _spawn_on(holder_node, "holder", pull_config)
    puller, _ = _spawn_on(puller_node, "puller", pull_config)
    prompt = _prompt(2)
    params = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    def generate(worker: Any, hint: HolderHint | None) -> Any:
        return worker.generate.options(num_returns="streaming").remote(
            prompt, params, uuid.uuid4().hex, None, hint
        )

    expected = [t for ref in generate(holder, None) for t in ray.get(ref).token_ids]
    # The holder freezes first, so that the pull is surely under way (asked, unanswered) when
    # its node goes; a frozen process cannot see its raylet die, so it is killed with the node.
    holder_pid = pid_of(holder)
    signal_pid(holder_pid, FREEZE)
    stream = generate(puller, HolderHint(holder_name, NUM_BLOCKS))
    time.sleep(1.0)  # the puller asks the frozen holder for its blocks meanwhile
    ray_nodes.remove(holder_node)
    signal_pid(holder_pid, KILL)

    deltas = [ray.get(ref) for ref in stream]
    assert all(isinstance(d, StreamDelta) for d in deltas), deltas
    assert [t for d in deltas for t in d.token_ids] == expected
    usage = deltas[-1].usage
    assert usage is not None and usage.computed_tokens == len(prompt)
    assert "peer" not in usage.cached_tokens


def _serving_worker(admin: pb_grpc.AdminStub) -> str:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        busy = [
            w.worker_id
            for w in admin.ListWorkers(pb.ListWorkersRequest()).workers
            if w.num_inflight
        ]
        if busy:
            return busy[0]
        time.sleep(0.01)
    raise AssertionError("no worker is serving the stream")


def test_a_node_removed_mid_stream_fails_over_with_the_same_tokens(
    ray_nodes: RayNodes,
    two_nodes: tuple[Any, Any],
    engine_config: EngineConfig,
    start_router: Any,
) -> None:
    pair = _pair(two_nodes, engine_config)
    node_of_worker = dict(zip(pair, two_nodes, strict=True))
    server = start_router({w: actor for w, (actor, _) in pair.items()}, policy="prefix_aware")
    stub = pb_grpc.InferenceStub(server.channel())
    admin = pb_grpc.AdminStub(server.channel())
    ids = [5, 17, 33, 99, 250, 3, 8, 64, 120, 7, 11]
    max_tokens = 200

    undisturbed = list(stub.Generate(_request(ids, max_tokens), timeout=120))
    expected = _tokens(undisturbed)
    assert len(expected) == max_tokens

    pids = {worker: pid_of(actor) for worker, (actor, _) in pair.items()}
    stream = stub.Generate(_request(ids, max_tokens), timeout=120)
    received = [next(stream) for _ in range(3)]
    victim = _serving_worker(admin)
    # Frozen first: a fast worker would otherwise finish the 200 tokens before its node is gone
    # (removing one takes longer than that); a frozen process cannot see its raylet die, so it
    # is killed with the node.
    signal_pid(pids[WorkerId(victim)], FREEZE)
    ray_nodes.remove(node_of_worker[WorkerId(victim)])
    signal_pid(pids[WorkerId(victim)], KILL)
    received += list(stream)

    assert _tokens(received) == expected, "the continuation must be identical"
    assert "".join(m.text for m in received) == "".join(m.text for m in undisturbed)
    finals = [m for m in received if m.finish_reason]
    assert len(finals) == 1 and finals[0] is received[-1]
    assert received[-1].usage.worker_id != victim
    stats = admin.Stats(pb.StatsRequest())
    assert stats.num_failed == 0 and stats.num_retries == 1
