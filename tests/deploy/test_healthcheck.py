"""deploy/docker/healthcheck.py against a real gRPC health service."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=30
    )


def test_serving_is_healthy_and_not_serving_is_not(
    health_server: tuple[str, health.HealthServicer],
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert _check(address).returncode == 0
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    failed = _check(address)
    assert failed.returncode == 1 and "NOT_SERVING" in failed.stderr
    servicer.set("cachesvc.v1.Admin", health_pb2.HealthCheckResponse.SERVING)
    assert _check(address, "cachesvc.v1.Admin").returncode == 0


def test_no_server_is_unhealthy(health_server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    unknown = _check(address, "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    result = _check(_unused_address())
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


def _unused_address() -> str:
    """A loopback address nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"
