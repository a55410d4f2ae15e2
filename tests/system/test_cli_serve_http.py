"""`cachesvc serve --http-port` as users run it: the OpenAI-compatible door answers the
`openai` client beside gRPC, under the model's folder name, and shuts down on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest
from cli_support import free_port, wait_serving
from test_cli_serve import ENGINE_ARGS

pytestmark = pytest.mark.system


def test_serve_with_an_http_port(ray_cluster: None, tiny_model_dir: Path, tmp_path: Path) -> None:
    import ray

    port, http_port = free_port(), free_port()
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), *ENGINE_ARGS]
    args += ["--ray-address", ray.get_runtime_context().gcs_address]
    args += ["--ray-namespace", f"http-{uuid.uuid4().hex[:8]}", "--http-port", str(http_port)]
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args], stderr=log)
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as r:
            assert r.status == 200
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        (model,) = client.models.list()
        assert model.id == tiny_model_dir.name, "named after the --model folder"
        reply = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "hello world"}],
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
        assert reply.choices[0].message.content
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "OpenAI-compatible API on http://127.0.0.1:" in (tmp_path / "serve.log").read_text()
