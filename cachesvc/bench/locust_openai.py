"""A locust workload for the OpenAI-compatible door, as `cachesvc bench router --doors` sends it:
chat requests sharing a system prompt, greedy, 16 tokens, half streamed (SSE), half whole.

    locust -f cachesvc/bench/locust_openai.py --headless -u 4 -r 4 -t 90s \\
        --host http://127.0.0.1:8000 --csv results/locust

Locust (a dev dependency) times each whole request end to end, a streamed one to its headers
(sent with the first token), and the streamed ones again under `ttft` (first content) and
`chat (stream) to [DONE]` (the last event). Set OPENAI_API_KEY when the router wants a token.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from typing import Any

from locust import HttpUser, between, task

SYSTEM = (
    "You are a helpful assistant for a travel company. Answer in two short sentences, suggest "
    "concrete places and foods, and keep a warm, practical tone. "
)
MAX_TOKENS = 16
_ids = itertools.count()


def _body(stream: bool) -> dict[str, Any]:
    i = next(_ids)
    question = f"Question {i}: where should I go on day {i % 7 + 1}?"
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class ChatUser(HttpUser):  # type: ignore[misc]
    wait_time = between(0, 0)

    def on_start(self) -> None:
        key = os.environ.get("OPENAI_API_KEY")
        if key:
            self.client.headers["Authorization"] = f"Bearer {key}"

    @task
    def whole(self) -> None:
        with self.client.post(
            "/v1/chat/completions", json=_body(False), name="chat", catch_response=True
        ) as reply:
            usage = reply.json().get("usage", {}) if reply.status_code == 200 else {}
            if usage.get("completion_tokens") != MAX_TOKENS:
                reply.failure(f"status {reply.status_code}, usage {usage}")

    @task
    def streamed(self) -> None:
        started = time.perf_counter()
        first: float | None = None
        tokens = 0
        with self.client.post(
            "/v1/chat/completions",
            json=_body(True),
            name="chat (stream)",
            stream=True,
            catch_response=True,
        ) as reply:
            for line in reply.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                    first = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            if tokens != MAX_TOKENS:
                reply.failure(f"status {reply.status_code}, {tokens} tokens")
        ended = time.perf_counter()
        if first is not None:  # locust times a streamed reply to its headers: add both ends
            for name, at in (("ttft", first), ("chat (stream) to [DONE]", ended)):
                self.environment.events.request.fire(
                    request_type="SSE",
                    name=name,
                    response_time=(at - started) * 1e3,
                    response_length=0,
                    exception=None,
                    context={},
                )
