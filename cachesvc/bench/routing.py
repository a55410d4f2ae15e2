"""`cachesvc bench routing`: every routing policy on the same workload, over real Ray workers
and a real gRPC router, one policy after another with the workers' caches flushed in between.

Reports, per policy: prefix-cache hit ratio, prompt tokens computed, TTFT p50/p99 (seen by the
client, from sending a request to its first token), output throughput, and load imbalance
(max / mean requests per worker). Greedy, fixed-length outputs (`ignore_eos`), so every policy
does the same work.

The `hot-prefix` workload (one long context forked into many requests) compares, over workers
started with `peer_pull`: affinity only (`longest_prefix`), load only (`least_loaded`: a worker
without the prefix recomputes it), and load-aware routing with pulls (the same policies with the
router's `peer_pull`: a worker without the prefix may pull it from its holder), with the
tokens and bytes pulled.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachesvc.kv.types import WorkerId
from cachesvc.workloads.routing import (
    WORKLOADS,
    RoutingBenchArgs,
    Variant,
    build_workload,
    variants_for,
)
from cachesvc.workloads.routing_report import (
    PolicyResult,
    RequestRecord,
    format_results,
    plot_results,
    summarize,
    to_json,
)
from cachesvc.workloads.sessions import (
    Session,
)
from cachesvc.workloads.table import write_json

# ---- one policy over live workers -----------------------------------------------------------


async def _run_session(
    stub: Any, session: Session, start: float
) -> tuple[list[RequestRecord], int]:
    from proto.cachesvc.v1 import cachesvc_pb2 as pb

    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + session.arrival_s - loop.time()))
    history = list(session.prefix_ids)
    records: list[RequestRecord] = []
    for turn in session.turns:
        prompt = history + list(turn.question_ids)
        request = pb.GenerateRequest(
            prompt=pb.Prompt(token_ids=pb.TokenIds(ids=prompt)),
            sampling=pb.SamplingParams(
                max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True
            ),
            no_response_cache=True,  # routing is measured: every request reaches a worker
        )
        sent, ttft, tokens, usage = loop.time(), None, [], None
        try:
            async for msg in stub.Generate(request, timeout=600):
                if ttft is None and msg.token_ids:
                    ttft = loop.time() - sent
                tokens.extend(msg.token_ids)
                if msg.HasField("usage"):
                    usage = msg.usage
        except Exception as exc:  # a failed request is counted, the run goes on
            print(f"request failed: {exc!r}"[:200], file=sys.stderr)
            return records, 1
        assert usage is not None and ttft is not None
        records.append(
            RequestRecord(
                pulled_tokens=usage.cached_tokens.get("peer", 0),
                worker=usage.worker_id,
                prompt_tokens=usage.prompt_tokens,
                cached_tokens=sum(usage.cached_tokens.values()),
                computed_tokens=usage.computed_tokens,
                output_tokens=len(tokens),
                ttft_s=ttft,
                latency_s=loop.time() - sent,
            )
        )
        history = prompt + tokens
        await asyncio.sleep(session.think_s)
    return records, 0


async def run_policy(
    actors: Mapping[WorkerId, Any],
    model: str | None,
    variant: Variant,
    sessions: Sequence[Session],
    workload: str = "custom",
    warm: Sequence[Session] = (),
) -> PolicyResult:
    """Serve `sessions` through a fresh router with `variant`'s policy over existing workers
    (their caches flushed first) and summarize what the client saw. `warm` sessions are served
    first, to the end, and not counted (hot-prefix's parent, which computes the context); the
    first of `sessions` is then sent at once, the others at their offsets from it."""
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2 as pb
    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer

    config = RouterConfig(policy=variant.policy, port=0, peer_pull=variant.peer_pull)
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            await pb_grpc.AdminStub(channel).Flush(pb.FlushRequest())
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(_run_session(stub, w, loop.time() - w.arrival_s) for w in warm))
            pulled_before = await _pulled_bytes(actors)
            start = loop.time() - min((s.arrival_s for s in sessions), default=0.0)
            began = time.perf_counter()
            done = await asyncio.gather(*(_run_session(stub, s, start) for s in sessions))
            wall_s = time.perf_counter() - began
            pulled = await _pulled_bytes(actors) - pulled_before
    finally:
        await server.stop(grace_s=1.0)
        await router.close()
    records = [r for rs, _ in done for r in rs]
    errors = sum(e for _, e in done)
    return summarize(variant.label, workload, records, sorted(actors), errors, wall_s, pulled)


async def _pulled_bytes(actors: Mapping[WorkerId, Any]) -> int:
    """KV bytes the workers have pulled from each other so far."""
    loads = await asyncio.gather(*(a.stats.remote() for a in actors.values()))
    return int(sum(load.tiering.get("peer_pulled_bytes", 0) for load in loads))


async def run_all_policies(
    actors: Mapping[WorkerId, Any],
    model: str | None,
    sessions: Sequence[Session],
    workload: str,
    variants: Sequence[Variant],
) -> list[PolicyResult]:
    """A short warm-up (first calls are slow), then each variant in turn on the same workload."""
    warmup = [Session(0.0, tuple(range(40, 72)), sessions[0].turns[:1]) for _ in actors]
    await run_policy(actors, model, Variant("warmup", "round_robin"), warmup, "warmup")
    results = []
    # Hot-prefix's parent computes the context before its forks are timed.
    warm, timed = (sessions[:1], sessions[1:]) if workload == "hot-prefix" else ((), sessions)
    for variant in variants:
        result = await run_policy(actors, model, variant, timed, workload, warm)
        print(f"  {variant.label}: done ({result.num_requests} requests)", file=sys.stderr)
        results.append(result)
    return results


def run_routing_bench(args: RoutingBenchArgs) -> int:
    """Blocking entry point of `cachesvc bench routing`; prints the table, returns 0."""
    import ray

    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig

    workloads = _workloads(args)
    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-") as tmp:
        model = args.model
        if args.tiny:
            from workers.model.tiny import write_tiny_model

            folder = Path(tmp) / "tiny-llama"
            model = str(write_tiny_model(folder, vocab_size=512, max_position_embeddings=2048))
        pulls = "hot-prefix" in workloads
        num_blocks = args.num_blocks or (1024 if pulls else 128)
        engine = EngineConfig.from_env(
            model=model, block_size=16, num_blocks=num_blocks, num_threads=1, peer_pull=pulls
        )
        ray.init(include_dashboard=False, log_to_driver=False)
        actors: dict[WorkerId, Any] = {}
        results: list[PolicyResult] = []
        try:
            actors = spawn_workers(WorkerGroup(engine, args.workers, device="cpu"))
            vocab = ray.get(next(iter(actors.values())).info.remote()).vocab_size
            for workload in workloads:
                sessions = build_workload(args, workload, vocab)
                num = sum(s.num_requests for s in sessions)
                print(f"{workload}: {num} requests, {args.workers} workers", file=sys.stderr)
                results += asyncio.run(
                    run_all_policies(actors, model, sessions, workload, variants_for(workload))
                )
        finally:
            stop_workers(actors)
            ray.shutdown()
    for workload in workloads:
        print(f"\nworkload {workload}:")
        print(format_results([r for r in results if r.workload == workload]))
    write_json(args.json_path, [to_json(r) for r in results])
    if args.plot_path:
        plot_results(results, args.plot_path)
    return 0


def _workloads(args: RoutingBenchArgs) -> list[str]:
    if args.workload == "all":
        return ["groups", "multiturn"] + (["trace"] if args.trace else [])
    if args.workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {WORKLOADS} or all, got {args.workload!r}")
    if args.workload == "trace" and args.trace is None:
        raise ValueError("--workload trace needs --trace FILE (a Mooncake JSONL trace)")
    return [args.workload]
