"""`cachesvc serve` as users run it (a subprocess on the session's Ray cluster), queried by
`cachesvc generate --server`, which prints what offline `generate --json` prints."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_support import free_port, wait_serving

from cachesvc.app.cli.main import main

pytestmark = pytest.mark.system
ENGINE_ARGS = ["--block-size", "4", "--num-blocks", "256", "--threads", "1"]
TIMING = ("request_id", "ttft_ms", "decode_tokens_per_s")


@pytest.fixture(scope="module")
def served(ray_cluster: None, tiny_model_dir: Path, tmp_path_factory: Any) -> Iterator[str]:
    import ray

    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text("cli-secret\n")
    address = f"127.0.0.1:{free_port()}"
    args = ["serve", "--model", str(tiny_model_dir), "--port", address.split(":")[1]]
    args += ["--ray-address", ray.get_runtime_context().gcs_address]
    args += ["--auth-token-file", str(token_file), *ENGINE_ARGS]
    proc = subprocess.Popen([sys.executable, "-m", "cachesvc.app.cli.main", *args])
    try:
        wait_serving(address, proc)
        yield address
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "serve must exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _json_lines(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[dict[str, Any]]:
    assert main(argv) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_generate_over_the_server_matches_offline(
    served: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "token").write_text("cli-secret")
    common = ["generate", "--json", "--max-tokens", "6", "--ignore-eos", "--chat"]
    common += ["--prompt", "hello world", "--prompt", "The quick brown fox"]
    offline = _json_lines(capsys, [*common, "--model", str(tiny_model_dir), *ENGINE_ARGS])
    remote = _json_lines(
        capsys, [*common, "--server", served, "--auth-token-file", str(tmp_path / "token")]
    )
    assert len(remote) == len(offline) == 2
    for here, there in zip(offline, remote, strict=True):
        assert there.pop("worker_id") == "worker-0"
        assert {k: v for k, v in here.items() if k not in TIMING} == {
            k: v for k, v in there.items() if k not in TIMING
        }


def test_generate_over_the_server_reports_errors(
    served: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "--server", served, "--prompt", "hi", "--max-tokens", "3"]
    assert main(argv) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_beam_search_over_the_server_matches_offline(
    served: str, tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "token").write_text("cli-secret")
    common = ["generate", "--json", "--max-tokens", "5", "--ignore-eos", "--beam-width", "3"]
    common += ["--prompt", "beams over the wire"]
    offline = _json_lines(capsys, [*common, "--model", str(tiny_model_dir), *ENGINE_ARGS])
    remote = _json_lines(
        capsys, [*common, "--server", served, "--auth-token-file", str(tmp_path / "token")]
    )
    assert [r["token_ids"] for r in remote] == [o["token_ids"] for o in offline]
    assert main([*common, "--server", served, "--length-penalty", "2"]) == 2
