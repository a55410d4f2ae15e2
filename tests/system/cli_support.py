"""Helpers for the system tests that run the `cachesvc` command: free ports, waiting for a
`cachesvc serve` process to report SERVING, running a client command in-process, and a command
in a process of its own."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachesvc.app.cli.main import main


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_serving(address: str, proc: subprocess.Popen[bytes], timeout_s: float = 90) -> None:
    """Until the health service at `address` says SERVING; fails if `proc` exits first."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, "cachesvc serve exited early"
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise AssertionError("cachesvc serve did not start serving in time")


def server_args(server: Any, token: str, folder: Path) -> list[str]:
    """`--server ADDRESS --auth-token-file F` for a client command, the token written to F."""
    (folder / "token").write_text(token + "\n")
    return ["--server", server.address, "--auth-token-file", str(folder / "token")]


def cli_lines(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    """Run `cachesvc argv` in this process; its stdout lines (it must exit 0)."""
    assert main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out.splitlines()


def run_cli(args: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """Run `cachesvc args` in a process of its own, as a user does (its own Ray cluster); it
    must exit 0 (else its stderr's end is shown)."""
    done = subprocess.run(
        [sys.executable, "-m", "cachesvc.app.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done
