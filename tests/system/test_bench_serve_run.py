"""`cachesvc bench serve --url` against a real `cachesvc serve` on loopback (its HTTP door, the
response cache off): every request answered with the tokens asked for, the shared prefix
served from the cache, the JSON's figures and texts, `--compare` against an earlier run, and
the distinct workload through `/v1/completions`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_support import free_port, wait_serving
from test_cli_serve import ENGINE_ARGS

from cachesvc.app.cli.main import main

pytestmark = pytest.mark.system
SMALL = ["--system-words", "16", "--question-words", "3", "--max-tokens", "4"]


@pytest.fixture(scope="module")
def http_url(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: Any) -> Iterator[str]:
    import ray

    port, http_port = free_port(), free_port()
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(port), *ENGINE_ARGS]
    args += ["--ray-address", ray.get_runtime_context().gcs_address, "--response-cache-mb", "0"]
    args += ["--ray-namespace", f"bench-serve-{uuid.uuid4().hex[:8]}"]
    args += ["--http-port", str(http_port)]
    proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args])
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{http_port}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run(url: str, out: Path, *extra: str) -> dict[str, Any]:
    argv = ["bench", "serve", "--url", url, "--num-requests", "6", "--concurrency", "2"]
    assert main([*argv, *SMALL, "--json", str(out), *extra]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_bench_serve_against_cachesvc_serve(http_url: str, tmp_path: Path) -> None:
    first = _run(http_url, tmp_path / "a.json", "--label", "ours")
    summary, answers = first["summary"], first["answers"]
    assert summary["num_requests"] == summary["num_ok"] == 6
    assert summary["output_tokens"] == 6 * 4, "ignore_eos: every answer has max_tokens tokens"
    assert [a["index"] for a in answers] == list(range(6))
    assert all(a["ok"] and a["text"] and a["completion_tokens"] == 4 for a in answers)
    assert all(len(a["gaps_s"]) >= 1 and a["prompt_tokens"] > 16 for a in answers)
    assert summary["cached_tokens"] > 0, "the shared system prompt is served from the cache"
    for name in ("requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"):
        assert summary[name] > 0, name
    for name in ("itl_mean_ms", "itl_p50_ms", "itl_p99_ms", "tpot_mean_ms", "e2e_p99_ms"):
        assert summary[name] > 0, name
    assert first["model"], "the name /v1/models gives"

    # The same prompts again, compared with the first run's texts doctored at prompt 0.
    answers[0]["text"] += " (not this)"
    (tmp_path / "doctored.json").write_text(json.dumps(first))
    second = _run(http_url, tmp_path / "b.json", "--compare", str(tmp_path / "doctored.json"))
    comparison = second["comparison"]
    assert comparison["compared"] == 6 and comparison["other_label"] == "ours"
    assert 0 in comparison["differ"]
    assert comparison["same_text"] + len(comparison["differ"]) == 6

    # Nothing shared, through /v1/completions: every answer, less (or no) prompt cached.
    distinct = _run(http_url, tmp_path / "d.json", "--workload", "distinct", "--api", "completions")
    assert distinct["summary"]["num_ok"] == 6
    assert all(a["ok"] and a["completion_tokens"] == 4 for a in distinct["answers"])
    assert (distinct["summary"]["cached_tokens"] or 0) < summary["cached_tokens"]
