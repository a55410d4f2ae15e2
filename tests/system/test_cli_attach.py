"""`cachesvc serve --attach`: a second router process routes over the workers a first
`cachesvc serve` started on the same Ray cluster (events through Redis Streams), leaves them
running on exit, and the first one closes them (its NVMe tier flushed) and kills them."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cli_support import free_port, wait_serving

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system
ENGINE_ARGS = ["--block-size", "4", "--num-blocks", "256", "--threads", "1"]
PROMPT = [10 + i for i in range(40)]  # ten blocks


@dataclass(frozen=True)
class Cluster:
    """What a `cachesvc serve` of this module runs against."""

    ray_address: str
    namespace: str
    redis_url: str
    model: Path


def _serve(cluster: Cluster, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    args = ["serve", "--model", str(cluster.model), "--port", str(port)]
    args += ["--ray-address", cluster.ray_address, "--ray-namespace", cluster.namespace]
    args += ["--redis-url", cluster.redis_url, "--redis-namespace", cluster.namespace]
    proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args, *extra])
    address = f"127.0.0.1:{port}"
    wait_serving(address, proc)
    return proc, address


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generate(address: str, ids: list[int]) -> pb.Usage:
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(
            prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
            sampling=pb.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        )
        replies = list(pb_grpc.InferenceStub(channel).Generate(request, timeout=60))
    assert replies[-1].finish_reason == "length"
    return replies[-1].usage


@pytest.fixture(scope="module")
def cluster(ray_cluster: None, tiny_model_dir: Path, redis_url: str) -> Cluster:
    import ray

    namespace = f"attach-{uuid.uuid4().hex[:8]}"
    return Cluster(ray.get_runtime_context().gcs_address, namespace, redis_url, tiny_model_dir)


def _named_workers(namespace: str) -> list[str]:
    import ray.util

    named = ray.util.list_named_actors(all_namespaces=True)
    return sorted(a["name"] for a in named if a["namespace"] == namespace)


def test_attach_routes_over_running_workers_and_leaves_them(
    cluster: Cluster, tmp_path: Path
) -> None:
    nvme = ["--nvme-path", str(tmp_path), "--nvme-mb", "16"]
    owner, owner_address = _serve(cluster, *ENGINE_ARGS, *nvme)
    try:
        assert _named_workers(cluster.namespace) == ["cachesvc-worker-0"]
        # Starting a second set of workers under the same names is refused, with the way out.
        clash = subprocess.run(
            [sys.executable, "-m", "cachesvc.app.cli.main", "serve", "--model", str(cluster.model)]
            + ["--ray-address", cluster.ray_address, "--ray-namespace", cluster.namespace],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert clash.returncode == 2 and "--attach" in clash.stderr, clash.stderr

        attached, attached_address = _serve(cluster, "--attach")
        usage = _generate(attached_address, PROMPT + [1])
        assert usage.worker_id == "worker-0" and usage.completion_tokens == 3
        assert _stop(attached) == 0, "an attached serve exits cleanly on SIGTERM"

        # The workers outlived the attached router, and their cache is the same.
        again = _generate(owner_address, PROMPT + [2])
        assert sum(again.cached_tokens.values()) >= len(PROMPT)
    finally:
        assert _stop(owner) == 0, "serve exits cleanly on SIGTERM"
    # Closed before it was killed: the device's cached blocks (both prompts' ten blocks at
    # least) were written down to NVMe, none half written.
    files = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert len(files) >= 10
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a write half done"
    deadline = time.monotonic() + 30
    while _named_workers(cluster.namespace):
        assert time.monotonic() < deadline, "the owning serve did not kill its workers"
        time.sleep(0.2)


def test_attach_without_workers_says_how_to_start_them(cluster: Cluster) -> None:
    nobody = f"nobody-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cachesvc.app.cli.main",
            "serve",
            "--attach",
            "--model",
            str(cluster.model),
        ]
        + ["--ray-address", cluster.ray_address, "--ray-namespace", nobody],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        f"no cachesvc workers in Ray namespace '{nobody}' at {cluster.ray_address}: "
        "start `cachesvc serve` there first"
    ) in result.stderr
