"""`make run`: `cachesvc demo-serve` starts the service on the embedded SmolLM2, answers every
demo user through gRPC and one more over the OpenAI-compatible HTTP API, reuses each
assistant's system prompt, and stops cleanly."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.system, pytest.mark.slow]


def test_demo_serve_runs_end_to_end() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cachesvc.app.cli.main", "demo-serve", "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    served = re.findall(r"-> (worker-\d) \| prompt (\d+) tokens: (\d+) cached", proc.stdout)
    assert len(served) == 6, proc.stdout
    assert {w for w, _, _ in served} == {"worker-0", "worker-1"}
    assert all(int(cached) > 0 for _, _, cached in served[2:]), "later users hit the cache"
    http = re.search(
        r"over HTTP \(POST /v1/chat/completions\).*\n  .+\n  prompt \d+ tokens, (\d+) cached",
        proc.stdout,
    )
    assert http is not None, proc.stdout
    assert int(http.group(1)) > 0, "the HTTP door reaches the same cache"
    assert "service stopped" in proc.stderr
