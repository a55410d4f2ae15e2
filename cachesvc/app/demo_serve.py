"""`make run`: the whole service on the embedded defaults, driven by a short demo workload.

Starts a local Ray cluster, worker actors (SmolLM2 unless `--model`), and the gRPC router on a
free loopback port; sends two assistants' users (each assistant a shared system prompt) through
the generated gRPC client; prints every answer with its cached / computed prompt tokens and the
worker that served it; asks one more question over the OpenAI-compatible HTTP API, as any
OpenAI client would; then stops everything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers.config import EngineConfig

SYSTEM_PROMPTS = {
    "travel": (
        "You are Atlas, a friendly travel assistant for a small tour company. Answer in two or "
        "three short sentences. Suggest concrete places, foods and timings; mention one budget "
        "tip when it fits; never invent prices; and keep a warm, practical tone."
    ),
    "kitchen": (
        "You are Basil, a patient cooking assistant for home cooks with little time. Answer in "
        "two or three short sentences. Prefer simple ingredients found in any supermarket, give "
        "quantities for two people, and say how long each step takes."
    ),
}


@dataclass(frozen=True)
class DemoRequest:
    assistant: str
    user: str
    question: str


# Two rounds: first one user per assistant (each system prompt computed once), then the rest,
# which the router sends to the worker that already holds their assistant's prompt, or, when
# that one is the busier, to the other, which pulls the prompt from it.
DEMO_ROUNDS: tuple[tuple[DemoRequest, ...], ...] = (
    (
        DemoRequest("travel", "alice", "What should I see in Paris in one day?"),
        DemoRequest("kitchen", "bob", "How do I make a quick tomato soup?"),
    ),
    (
        DemoRequest("travel", "carol", "Is Lisbon good for a weekend trip?"),
        DemoRequest("kitchen", "dave", "What can I cook with eggs and spinach?"),
        DemoRequest("travel", "erin", "Where should I eat in Rome?"),
        DemoRequest("kitchen", "frank", "How long should I boil pasta?"),
    ),
)


@dataclass(frozen=True)
class DemoAnswer:
    request: DemoRequest
    text: str
    worker: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    completion_tokens: int
    ttft_ms: float
    pulled_tokens: int = 0  # of the cached ones, pulled from another worker


async def _ask(stub: Any, req: DemoRequest, max_tokens: int) -> DemoAnswer:
    from proto.cachesvc.v1 import cachesvc_pb2 as pb
    from workers.protocol import PEER_TOKENS

    messages = [
        pb.ChatMessage(role="system", content=SYSTEM_PROMPTS[req.assistant]),
        pb.ChatMessage(role="user", content=req.question),
    ]
    request = pb.GenerateRequest(
        request_id=f"demo-{req.user}",
        prompt=pb.Prompt(chat=pb.ChatMessages(messages=messages)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )
    text, usage = "", None
    async for msg in stub.Generate(request, timeout=300):
        text += msg.text
        if msg.HasField("usage"):
            usage = msg.usage
    assert usage is not None, "a finished stream carries usage"
    return DemoAnswer(
        req,
        text.strip(),
        usage.worker_id,
        usage.prompt_tokens,
        sum(usage.cached_tokens.values()),
        usage.computed_tokens,
        usage.completion_tokens,
        usage.ttft_ms,
        usage.cached_tokens.get(PEER_TOKENS, 0),
    )


def _print_answer(a: DemoAnswer) -> None:
    r = a.request
    print(f"\n[{r.assistant}] {r.user}: {r.question}")
    print(f"  {a.text}")
    pulled = f" ({a.pulled_tokens} pulled from another worker)" if a.pulled_tokens else ""
    print(
        f"  -> {a.worker} | prompt {a.prompt_tokens} tokens: {a.cached_tokens} cached{pulled}, "
        f"{a.computed_tokens} computed | {a.completion_tokens} generated | "
        f"TTFT {a.ttft_ms:.0f} ms",
        flush=True,
    )


async def _drive(actors: dict[Any, Any], engine: EngineConfig, max_tokens: int) -> list[DemoAnswer]:
    import grpc

    from cachesvc.app.serve import served_model_name
    from proto.cachesvc.v1 import cachesvc_pb2 as pb
    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer
    from router.http.server import HttpServer

    config = RouterConfig(port=0, policy="prefix_aware")
    router = await build_router(actors, config, engine.model)
    server = RouterServer(router, config)
    await server.start()
    http = HttpServer(router, config, 0, served_model_name(engine.model))
    await http.start()
    print(f"router on 127.0.0.1:{server.port}, policy prefix_aware, {len(actors)} workers")
    print(f"OpenAI-compatible API on http://127.0.0.1:{http.port}/v1")
    answers: list[DemoAnswer] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            for round_ in DEMO_ROUNDS:
                done = await asyncio.gather(*(_ask(stub, r, max_tokens) for r in round_))
                for answer in done:
                    _print_answer(answer)
                answers.extend(done)
            stats = await pb_grpc.AdminStub(channel).Stats(pb.StatsRequest())
            print(
                f"\nrouter: {stats.num_requests} requests, {stats.cached_tokens} of "
                f"{stats.prompt_tokens} prompt tokens from the cache "
                f"(hit ratio {stats.cache_hit_ratio:.2f})"
            )
        await _ask_over_http(http.port, http.door.model_name, max_tokens)
    finally:
        await http.stop(grace_s=1.0)
        await server.stop(grace_s=1.0)
        await router.close()
    return answers


async def _ask_over_http(port: int, model: str, max_tokens: int) -> None:
    """One more travel question, as any OpenAI client sends it: POST /v1/chat/completions."""
    req = DemoRequest("travel", "grace", "What should I pack for a rainy week in London?")
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPTS[req.assistant]},
            {"role": "user", "content": req.question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )

    def post() -> dict[str, Any]:
        with urllib.request.urlopen(request, timeout=300) as reply:
            answer: dict[str, Any] = json.load(reply)
            return answer

    answer = await asyncio.to_thread(post)
    usage = answer["usage"]
    print(f"\nover HTTP (POST /v1/chat/completions) [{req.assistant}] {req.user}: {req.question}")
    print(f"  {answer['choices'][0]['message']['content'].strip()}")
    print(
        f"  prompt {usage['prompt_tokens']} tokens, "
        f"{usage['prompt_tokens_details']['cached_tokens']} cached | "
        f"{usage['completion_tokens']} generated",
        flush=True,
    )


def _threads_per_worker(engine: EngineConfig, num_workers: int) -> EngineConfig:
    # Workers share the machine's cores; torch would otherwise take all of them in each.
    if engine.num_threads is not None:
        return engine
    return dataclasses.replace(engine, num_threads=max(1, (os.cpu_count() or 1) // num_workers))


def run_demo_serve(engine: EngineConfig, num_workers: int = 2, max_tokens: int = 24) -> int:
    """Start, drive and stop the service; returns the exit status (0 when every request was
    answered)."""
    import ray

    from workers.cluster import WorkerGroup, spawn_workers, stop_workers

    started = time.perf_counter()
    # Workers pull a prefix another one holds when that is cheaper than computing it: a user the
    # router sends away from its assistant's worker (both busy at once) still reuses the prompt.
    engine = dataclasses.replace(_threads_per_worker(engine, num_workers), peer_pull=True)
    ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    actors: dict[Any, Any] = {}
    try:
        actors = spawn_workers(WorkerGroup(engine, num_workers))
        print(f"starting {num_workers} workers (the model loads in each) ...", flush=True)
        answers = asyncio.run(_drive(actors, engine, max_tokens))
    finally:
        stop_workers(actors)
        ray.shutdown()
    _summary(answers, time.perf_counter() - started)
    return 0 if len(answers) == sum(len(r) for r in DEMO_ROUNDS) else 1


def _summary(answers: Sequence[DemoAnswer], wall_s: float) -> None:
    per_worker: dict[str, list[str]] = {}
    for a in answers:
        per_worker.setdefault(a.worker, []).append(a.request.assistant)
    for worker, assistants in sorted(per_worker.items()):
        print(f"{worker} served: {', '.join(assistants)}")
    print(f"done in {wall_s:.0f} s; service stopped", file=sys.stderr)
