"""`cachesvc serve --ray-address` on a Ray cluster of several nodes: it joins the cluster, its
workers are spread over the nodes (one per node where a node could hold two), it logs where
each one landed, and a pull between workers on two nodes gives the same greedy tokens. A node
that leaves costs its worker, not a request: the answers stay the same, and the worker comes
back on the node that has room."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cli_support import free_port, wait_serving
from multinode_support import RayNodes, node_of

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from workers.config import EngineConfig

pytestmark = pytest.mark.system
PROMPT = [(37 + 11 * j) % 300 + 3 for j in range(42)]  # ten full blocks of 4


@pytest.fixture
def roomy_nodes(ray_nodes: RayNodes) -> Iterator[tuple[RayNodes, list[Any]]]:
    """Two fresh worker nodes of two CPUs each: either could hold both workers of a pair (a
    test may remove one)."""
    nodes = [ray_nodes.add(num_cpus=2), ray_nodes.add(num_cpus=2)]
    yield ray_nodes, nodes
    for node in nodes:
        ray_nodes.remove(node)


def test_spawn_workers_spreads_them_over_the_nodes(
    roomy_nodes: tuple[RayNodes, list[Any]], engine_config: EngineConfig
) -> None:
    from workers.cluster import WorkerGroup, spawn_workers, stop_workers

    # Half a CPU each: Ray's default scheduler would put both on one node.
    group = WorkerGroup(
        engine_config, 2, f"spread-{uuid.uuid4().hex[:6]}", "cpu", num_cpus_per_worker=0.5
    )
    actors = spawn_workers(group)
    try:
        nodes = {worker: node_of(actor) for worker, actor in actors.items()}
    finally:
        stop_workers(actors, close_timeout_s=30)
    assert len(set(nodes.values())) == 2, nodes


def _generate(stub: pb_grpc.InferenceStub) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=PROMPT)),
        sampling=pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    )
    replies = list(stub.Generate(request, timeout=120))
    tokens = [t for r in replies for t in r.token_ids]
    return pb.GenerateResponse(token_ids=tokens, usage=replies[-1].usage)


@dataclass(frozen=True)
class Served:
    """A `cachesvc serve` process of a test: where it listens, its workers' Ray namespace and
    the file its log goes to."""

    address: str
    namespace: str
    log: Path

    def worker(self, worker: str) -> Any:
        import ray

        return ray.get_actor(f"cachesvc-{worker}", namespace=self.namespace)

    def node_of(self, worker: str, timeout_s: float = 120) -> str:
        return node_of(self.worker(worker), timeout_s)


@contextlib.contextmanager
def _serve(ray_address: str, model: Path, folder: Path) -> Iterator[Served]:
    """Two workers with pulls between them over `ray_address`, routed round robin; serve must
    exit 0 on SIGTERM at the end."""
    config = folder / "serve.yaml"
    # A forced fetch: the tiny model computes a prompt faster than a pull's prior cost.
    config.write_text("engine:\n  tiers: {plan: fetch, calibrate: false}\n")
    served = Served(f"127.0.0.1:{free_port()}", f"serve-{uuid.uuid4().hex[:6]}", folder / "log")
    args = ["serve", "--model", str(model), "--port", served.address.split(":")[1]]
    args += ["--workers", "2", "--ray-address", ray_address, "--ray-namespace", served.namespace]
    args += ["--peer-pull", "--policy", "round_robin", "--config", str(config)]
    args += ["--response-cache-mb", "0"]  # the same request again must reach a worker
    args += ["--block-size", "4", "--num-blocks", "256", "--threads", "1"]
    with served.log.open("w") as log:  # a file, not a pipe: a full pipe would block serve
        proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args], stderr=log)
    try:
        wait_serving(served.address, proc)
        yield served
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, "serve must exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_joins_by_address_spreads_and_pulls_across_nodes(
    roomy_nodes: tuple[RayNodes, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    ray_nodes, _ = roomy_nodes
    with _serve(ray_nodes.address, tiny_model_dir, tmp_path) as served:
        nodes = {worker: served.node_of(worker) for worker in ("worker-0", "worker-1")}
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            computed, pulled = _generate(stub), _generate(stub)
    assert len(set(nodes.values())) == 2, nodes
    assert pulled.usage.worker_id != computed.usage.worker_id
    assert list(pulled.token_ids) == list(computed.token_ids)
    assert dict(pulled.usage.cached_tokens) == {"peer": 40}
    # The log says where each worker landed.
    log = served.log.read_text()
    for worker, node in nodes.items():
        assert re.search(rf"{worker} runs on node {node[:12]} at \S+ \(cpu\)", log), log
    assert "2 workers on 2 Ray nodes (1 + 1)" in log


def test_a_node_leaving_costs_its_worker_not_a_request(
    roomy_nodes: tuple[RayNodes, list[Any]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    ray_nodes, nodes = roomy_nodes
    with _serve(ray_nodes.address, tiny_model_dir, tmp_path) as served:
        by_id = {node.node_id: node for node in nodes}
        lost = by_id.pop(served.node_of("worker-0"))
        [kept] = by_id
        with grpc.insecure_channel(served.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            expected = _generate(stub)
            ray_nodes.remove(lost)
            after = [_generate(stub) for _ in range(2)]  # round robin: each worker's turn
            # Ray starts the lost worker again on the node that has room left, and the router
            # routes to it again.
            admin = pb_grpc.AdminStub(channel)
            deadline = time.monotonic() + 300
            while not _back_on(served, admin, kept) and time.monotonic() < deadline:
                time.sleep(1.0)
            assert _back_on(served, admin, kept), "worker-0 did not come back"
            again = [_generate(stub) for _ in range(2)]
    for reply in after + again:
        assert list(reply.token_ids) == list(expected.token_ids)
    assert {r.usage.worker_id for r in again} == {"worker-0", "worker-1"}


def _back_on(served: Served, admin: pb_grpc.AdminStub, node_id: str) -> bool:
    """Whether worker-0 runs on `node_id` and the router has it HEALTHY."""
    from ray.exceptions import GetTimeoutError, RayError

    try:
        if served.node_of("worker-0", timeout_s=5) != node_id:
            return False
    except (RayError, GetTimeoutError, ValueError):  # restarting, or its name not yet taken
        return False
    workers = admin.ListWorkers(pb.ListWorkersRequest()).workers
    return any(w.worker_id == "worker-0" and w.health == pb.WorkerInfo.HEALTHY for w in workers)
