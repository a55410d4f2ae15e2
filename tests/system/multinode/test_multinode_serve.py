"""`cachesvc serve --ray-address` on a Ray cluster of several nodes: it joins the cluster, its
workers are spread over the nodes (one per node where a node could hold two), it logs where
each one landed, and a pull between workers on two nodes gives the same greedy tokens."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from cli_support import free_port, wait_serving
from multinode_support import RayNodes, node_of

from cachesvc.config import EngineConfig
from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system
PROMPT = [(37 + 11 * j) % 300 + 3 for j in range(42)]  # ten full blocks of 4


@pytest.fixture(scope="module")
def roomy_nodes(ray_nodes: RayNodes) -> Iterator[RayNodes]:
    """Two worker nodes of two CPUs each: either could hold both workers of a pair."""
    nodes = [ray_nodes.add(num_cpus=2), ray_nodes.add(num_cpus=2)]
    yield ray_nodes
    for node in nodes:
        ray_nodes.remove(node)


def test_spawn_workers_spreads_them_over_the_nodes(
    roomy_nodes: RayNodes, engine_config: EngineConfig
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


def test_serve_joins_by_address_spreads_and_pulls_across_nodes(
    roomy_nodes: RayNodes, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import ray

    config = tmp_path / "serve.yaml"
    # A forced fetch: the tiny model computes a prompt faster than a pull's prior cost.
    config.write_text("engine:\n  tiers: {plan: fetch, calibrate: false}\n")
    namespace = f"serve-{uuid.uuid4().hex[:6]}"
    port = free_port()
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), "--workers", "2"]
    args += ["--ray-address", roomy_nodes.address, "--ray-namespace", namespace]
    args += ["--peer-pull", "--policy", "round_robin", "--config", str(config)]
    args += ["--response-cache-mb", "0"]  # the second, same request must reach a worker
    args += ["--block-size", "4", "--num-blocks", "256", "--threads", "1"]
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:  # a file, not a pipe: a full pipe would block serve
        proc = subprocess.Popen(
            [sys.executable, "-m", "cachesvc.app.cli.main", *args], stderr=log_file
        )
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        workers = {
            name: ray.get_actor(name, namespace=namespace)
            for name in ("cachesvc-worker-0", "cachesvc-worker-1")
        }
        nodes = {name: node_of(actor) for name, actor in workers.items()}
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            computed, pulled = _generate(stub), _generate(stub)
    finally:
        _stop(proc)
    log = log_path.read_text()
    assert len(set(nodes.values())) == 2, nodes
    assert not pulled.usage.from_response_cache
    assert pulled.usage.worker_id != computed.usage.worker_id
    assert list(pulled.token_ids) == list(computed.token_ids)
    assert dict(pulled.usage.cached_tokens) == {"peer": 40}
    # The log says where each worker landed.
    for name, node in nodes.items():
        worker = name.removeprefix("cachesvc-")
        assert re.search(rf"{worker} runs on node {node[:12]} at \S+ \(cpu\)", log), log
    assert "2 workers on 2 Ray nodes (1 + 1)" in log


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=90) == 0, "serve must exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
