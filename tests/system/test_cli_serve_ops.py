"""`cachesvc serve` with the operations flags, as users run it: the index in Redis, Prometheus
metrics on a port, JSON request logs on stderr."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import pytest
from cli_support import free_port, wait_serving
from test_cli_serve import ENGINE_ARGS

from cachesvc.app.cli.main import main

pytestmark = pytest.mark.system


def test_serve_with_redis_metrics_and_json_logs(
    ray_cluster: None,
    tiny_model_dir: Path,
    redis_url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import ray
    import redis

    port, metrics_port = free_port(), free_port()
    namespace = f"cli-{uuid.uuid4().hex[:8]}"
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), *ENGINE_ARGS]
    args += ["--ray-address", ray.get_runtime_context().gcs_address]
    args += ["--redis-url", redis_url, "--redis-namespace", namespace]
    args += ["--metrics-port", str(metrics_port), "--log-format", "json"]
    args += ["--max-queued-per-worker", "4"]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args], stderr=log)
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        argv = ["generate", "--server", f"127.0.0.1:{port}", "--prompt", "hello world"]
        assert main([*argv, "--max-tokens", "3", "--json"]) == 0
        served = json.loads(capsys.readouterr().out.splitlines()[0])

        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            metrics = reply.read().decode()
        assert 'cachesvc_requests_total{door="grpc",method="Generate",status="OK"} 1.0' in metrics
        keys = redis.Redis.from_url(redis_url).keys(f"{namespace}:*")
        assert any(b":s:worker-0" in k for k in keys), "the index lives in Redis"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    lines = [
        json.loads(x) for x in (tmp_path / "serve.log").read_text().splitlines() if x[:1] == "{"
    ]
    finished = [x for x in lines if x["message"] == "request finished"]
    assert len(finished) == 1 and finished[0]["request_id"] == served["request_id"]
    assert finished[0]["status"] == "ok" and finished[0]["worker"] == "worker-0"
