"""One streamed OpenAI request, timed: what `cachesvc bench serve` sends to any server.

Blocking (the standard library's `http.client`, one connection per request), so the bench runs
one thread per stream. Server-sent events are read line by line as they arrive: the first
chunk with text marks the time to first token, each later chunk with text one inter-token gap
(vLLM's `benchmark_serving` measures the same way), and the usage chunk
(`stream_options.include_usage`) gives the token counts the server counted.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from cachesvc.bench.serve_workload import ServePrompt

APIS = ("chat", "completions")


@dataclass
class Answer:
    """One request's answer and timings (seconds; `sent_s` from the run's start)."""

    index: int
    ok: bool = False
    error: str = ""
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    completion_tokens: int = 0
    sent_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    last_token_s: float = 0.0  # from sending to the last chunk with text
    gaps_s: list[float] = field(default_factory=list)  # between chunks with text

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None below two tokens."""
        if self.completion_tokens < 2:
            return None
        return (self.last_token_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class OpenAIServer:
    """Where and how to send: a base URL (`http://host:port`, `/v1` optional), which API, the
    model's name, and the generation every request asks for (greedy, `max_tokens` always)."""

    url: str
    api: str
    model: str
    max_tokens: int
    api_key: str | None = None
    timeout_s: float = 600.0

    def body(self, prompt: ServePrompt) -> dict[str, Any]:
        """The request body: greedy, no early end of sequence (`ignore_eos`, which vLLM and we
        both take), streamed with usage."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.api == "chat":
            body["messages"] = prompt.messages()
        else:
            body["prompt"] = prompt.text()
        return body

    def connect(self) -> tuple[http.client.HTTPConnection, str]:
        """A new connection and the path prefix (`.../v1`)."""
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--url must be http(s)://host[:port][/v1], got {self.url!r}")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        path = parts.path.rstrip("/")
        path = path if path.endswith("/v1") else path + "/v1"
        return cls(parts.hostname, parts.port, timeout=self.timeout_s), path

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def first_model(self) -> str:
        """The first model `GET /v1/models` lists (a server's own name for its model)."""
        conn, path = self.connect()
        try:
            conn.request("GET", f"{path}/models", headers=self.headers())
            reply = conn.getresponse()
            data = reply.read()
        finally:
            conn.close()
        if reply.status != 200:
            raise RuntimeError(f"GET {path}/models: HTTP {reply.status}: {data[:200]!r}")
        return str(json.loads(data)["data"][0]["id"])

    def send(self, prompt: ServePrompt, index: int, run_start: float) -> Answer:
        """Send one request and read its stream to the end; never raises (a failure is an
        `Answer` with `ok` False and the error)."""
        answer = Answer(index)
        conn, path = self.connect()
        endpoint = f"{path}/chat/completions" if self.api == "chat" else f"{path}/completions"
        start = time.perf_counter()
        answer.sent_s = start - run_start
        try:
            conn.request("POST", endpoint, json.dumps(self.body(prompt)), self.headers())
            reply = conn.getresponse()
            if reply.status != 200:
                answer.error = f"HTTP {reply.status}: {reply.read()[:300]!r}"
                return answer
            self._read_stream(reply, answer, start)
        except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
            answer.error = f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()
        answer.e2e_s = time.perf_counter() - start
        answer.ok = not answer.error and answer.completion_tokens > 0
        if not answer.ok and not answer.error:
            answer.error = "the stream ended without usage or text"
        return answer

    def _read_stream(self, reply: http.client.HTTPResponse, answer: Answer, start: float) -> None:
        pieces: list[str] = []
        previous: float | None = None
        for raw in iter(reply.readline, b""):
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, `event:` lines
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                answer.error = f"error event: {chunk['error']}"
                return
            text = "".join(self._chunk_text(c) for c in chunk.get("choices") or ())
            if text:
                now = time.perf_counter() - start
                if previous is None:
                    answer.ttft_s = now
                else:
                    answer.gaps_s.append(now - previous)
                previous = answer.last_token_s = now
                pieces.append(text)
            if chunk.get("usage"):
                self._take_usage(chunk["usage"], answer)
        answer.text = "".join(pieces)

    def _chunk_text(self, choice: dict[str, Any]) -> str:
        if self.api == "chat":
            return str((choice.get("delta") or {}).get("content") or "")
        return str(choice.get("text") or "")

    @staticmethod
    def _take_usage(usage: dict[str, Any], answer: Answer) -> None:
        answer.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        answer.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            answer.cached_tokens = int(details["cached_tokens"])
