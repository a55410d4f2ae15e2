"""`cachesvc serve` with pulls between two workers on one Ray node: the worker a request is routed
to pulls the prompt's blocks from the one that computed them through the holder's
shared-memory slots (the holder's counters on the metrics endpoint say so), says the same
greedy tokens, and the slots go back to the holder once the blocks landed."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cli_support import free_port, wait_serving
from test_cli_serve import ENGINE_ARGS

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

pytestmark = pytest.mark.system
NUM_BLOCKS = 10  # full blocks of every prompt below (block size 4)


def _request(seed: int) -> pb.GenerateRequest:
    ids = [(seed * 37 + 11 * j) % 300 + 3 for j in range(NUM_BLOCKS * 4 + 2)]
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )


def _holders(metrics_port: int, counter: str) -> float:
    """`counter` of the workers' exporters, summed over the workers."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    pattern = rf'cachesvc_worker_tiering_total\{{counter="{counter}",worker="[^"]+"\}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text))


def _until(metrics_port: int, counter: str, done: Callable[[float], bool]) -> float:
    """The counter once `done(value)` holds (the workers report at their next poll); the last
    value seen after a minute."""
    deadline = time.monotonic() + 60
    value = _holders(metrics_port, counter)
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.2)
        value = _holders(metrics_port, counter)
    return value


def test_serve_pulls_through_the_holders_slots(
    ray_cluster: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import ray

    port, metrics_port = free_port(), free_port()
    config = tmp_path / "serve.yaml"
    # A forced fetch: the tiny model computes a prompt faster than a pull's prior cost.
    config.write_text("engine:\n  tiers: {plan: fetch, calibrate: false}\n")
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), *ENGINE_ARGS]
    args += ["--ray-address", ray.get_runtime_context().gcs_address]
    args += ["--ray-namespace", f"slots-{uuid.uuid4().hex[:6]}", "--workers", "2"]
    args += ["--peer-pull", "--policy", "round_robin", "--config", str(config)]
    args += ["--response-cache-mb", "0", "--metrics-port", str(metrics_port)]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args], stderr=log)
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            # Each prompt twice, round robin: computed by one worker, pulled by the other. The
            # holders make their slots when first asked, so the first pulls may go through the
            # object store; every pull must give the computed tokens.
            for seed in range(8):
                computed = list(stub.Generate(_request(seed), timeout=120))
                pulled = list(stub.Generate(_request(seed), timeout=120))
                assert [t for m in pulled for t in m.token_ids] == [
                    t for m in computed for t in m.token_ids
                ]
                assert dict(pulled[-1].usage.cached_tokens) == {"peer": NUM_BLOCKS * 4}
                # The holders report what they sent at their next poll.
                _until(metrics_port, "peer_exported_chunks", lambda v, n=seed: v > n)
                if _holders(metrics_port, "peer_exported_local_chunks") > 0:
                    break
        assert _holders(metrics_port, "peer_exported_local_chunks") > 0
        assert _until(metrics_port, "peer_slots_leased", lambda v: v == 0) == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
