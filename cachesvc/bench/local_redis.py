"""A throwaway redis-server on a free loopback port, for benchmarks and tests.

No persistence; the process is ours to stop, kill and restart on the same port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def redis_server_binary() -> str | None:
    """Path of `redis-server`, or None when it is not installed."""
    return shutil.which("redis-server")


class LocalRedis:
    """One redis-server bound to 127.0.0.1; `start` waits until it answers PING."""

    def __init__(self, workdir: Path | None = None, password: str | None = None) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self._binary = binary
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.workdir = workdir
        self.password = password
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> LocalRedis:
        args = [self._binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--appendonly", "no"]
        if self.workdir is not None:
            args += ["--dir", str(self.workdir)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import redis

        client = redis.Redis.from_url(self.url, password=self.password)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)

    def stop(self, kill: bool = False) -> None:
        """Terminate (or kill, as a crash would) the server; a no-op when it is not running."""
        if self.proc is not None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def local_redis(workdir: Path | None = None) -> Iterator[str]:
    """The URL of a fresh server for the duration of the block; FileNotFoundError if none."""
    server = LocalRedis(workdir).start()
    try:
        yield server.url
    finally:
        server.stop()
