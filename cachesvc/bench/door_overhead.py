"""`cachesvc bench router --doors`: the router process's own CPU per request, door by door.

Starts `cachesvc serve` (one worker, the response cache off, gRPC and HTTP ports) as a child
process and sends the same workload through each door: distinct chat prompts sharing a system
prompt, greedy, `max_tokens` tokens each, a few clients at once. The router's cost is the CPU
time its process spent (all threads: gRPC, HTTP, tokenizing, hashing, routing, Ray calls), read
from /proc before and after each door's batch, less what it spends idle (polls, health) over
the batch's wall time, per request. The worker's compute runs in other processes and is not
counted. Doors take turns, round after round, so drift on a shared machine hits each alike.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from cachesvc.workloads.table import format_table, write_json

DOORS = ("grpc", "http-stream", "http")
SYSTEM = (
    "You are a helpful assistant for a travel company. Answer in two short sentences, suggest "
    "concrete places and foods, and keep a warm, practical tone. "
)
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class DoorResult:
    door: str
    num_requests: int
    cpu_ms_per_request: float  # the router process's, idle CPU taken out
    wall_s: float
    requests_per_s: float


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Question {i}: where should I go on day {i % 7 + 1}?"},
    ]


class _Clients:
    """One blocking call per door, safe to run from many threads."""

    def __init__(self, grpc_port: int, http_port: int, max_tokens: int) -> None:
        import grpc

        from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

        self._channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._http_port = http_port
        self._max_tokens = max_tokens

    def grpc(self, i: int) -> int:
        from proto.cachesvc.v1 import cachesvc_pb2 as pb

        chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in _messages(i)])
        request = pb.GenerateRequest(
            prompt=pb.Prompt(chat=chat),
            sampling=pb.SamplingParams(
                max_tokens=self._max_tokens, temperature=0.0, ignore_eos=True
            ),
        )
        return sum(len(m.token_ids) for m in self._stub.Generate(request, timeout=600))

    def http(self, i: int, stream: bool = False) -> int:
        body = {
            "messages": _messages(i),
            "max_tokens": self._max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        conn = http.client.HTTPConnection("127.0.0.1", self._http_port, timeout=600)
        conn.request("POST", "/v1/chat/completions", json.dumps(body), _JSON)
        reply = conn.getresponse()
        data = reply.read()
        conn.close()
        if reply.status != 200:
            raise RuntimeError(f"HTTP {reply.status}: {data[:200]!r}")
        if stream:
            last = data.rsplit(b"data: ", 2)[1]  # the usage chunk, before [DONE]
            return int(json.loads(last)["usage"]["completion_tokens"])
        return int(json.loads(data)["usage"]["completion_tokens"])

    def call(self, door: str) -> Callable[[int], int]:
        if door == "grpc":
            return self.grpc
        return lambda i: self.http(i, stream=door == "http-stream")

    def close(self) -> None:
        self._channel.close()


_JSON = {"Content-Type": "application/json"}


def _serve(model: str | None, grpc_port: int, http_port: int) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "cachesvc.app.cli.main", "serve", "--workers", "1"]
    args += ["--port", str(grpc_port), "--http-port", str(http_port), "--response-cache-mb", "0"]
    if model is not None:
        args += ["--model", model]
    return subprocess.Popen(args, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)


def _wait_ready(proc: subprocess.Popen[bytes], http_port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("cachesvc serve exited before serving")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("cachesvc serve did not become ready in time")


def measure(
    model: str | None, num_requests: int, rounds: int, concurrency: int, max_tokens: int
) -> list[DoorResult]:
    """Start a router, send `num_requests` per door and round, and stop it."""
    grpc_port, http_port = _free_port(), _free_port()
    proc = _serve(model, grpc_port, http_port)
    clients: _Clients | None = None
    try:
        _wait_ready(proc, http_port)
        clients = _Clients(grpc_port, http_port, max_tokens)
        with ThreadPoolExecutor(concurrency) as pool:
            for door in DOORS:  # warm every path (and the KV of the system prompt) first
                list(pool.map(clients.call(door), range(concurrency)))
            idle_rate = _idle_cpu_rate(proc.pid, 3.0)
            cpu = {d: 0.0 for d in DOORS}
            wall = {d: 0.0 for d in DOORS}
            offset = concurrency
            for _ in range(rounds):
                for door in DOORS:
                    ids = range(offset, offset + num_requests)
                    offset += num_requests
                    t0, c0 = time.perf_counter(), _cpu_s(proc.pid)
                    tokens = list(pool.map(clients.call(door), ids))
                    spent, c1 = time.perf_counter() - t0, _cpu_s(proc.pid)
                    assert all(t == max_tokens for t in tokens), f"{door}: short answers"
                    wall[door] += spent
                    cpu[door] += c1 - c0 - idle_rate * spent
    finally:
        if clients is not None:
            clients.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
    total = num_requests * rounds
    return [DoorResult(d, total, cpu[d] / total * 1e3, wall[d], total / wall[d]) for d in DOORS]


def _idle_cpu_rate(pid: int, seconds: float) -> float:
    c0 = _cpu_s(pid)
    time.sleep(seconds)
    return (_cpu_s(pid) - c0) / seconds


def format_results(results: list[DoorResult]) -> str:
    base = results[0].cpu_ms_per_request
    rows: list[list[Any]] = [
        [
            r.door,
            r.num_requests,
            f"{r.cpu_ms_per_request:.2f}",
            f"{(r.cpu_ms_per_request / base - 1) * 100:+.1f}%" if base > 0 else "-",
            f"{r.requests_per_s:.1f}",
        ]
        for r in results
    ]
    headers = ["door", "requests", "router CPU ms/req", "vs grpc", "req/s"]
    return format_table(headers, rows)


def run_door_overhead_bench(model: str | None, quick: bool, json_path: str | None) -> int:
    """Blocking entry point of `cachesvc bench router --doors`; prints the table, returns 0."""
    num_requests, rounds = (16, 2) if quick else (48, 3)
    results = measure(model, num_requests, rounds, concurrency=4, max_tokens=16)
    print(
        f"router process CPU per request, by door (1 worker, {rounds} rounds, 4 clients, "
        "16 greedy tokens, chat prompts sharing a system prompt, response cache off):"
    )
    print(format_results(results))
    write_json(json_path, [r.__dict__ for r in results])
    return 0
