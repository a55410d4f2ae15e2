"""`cachesvc bench pd`: decode streams while long prompts arrive, on two mixed workers against
one prefill and one decode worker.

Two real workers on this machine (the default model, or a tiny one), behind a real router and
its gRPC door. In each setup, first `streams` long greedy decodes run alone; then the same
decodes run again while `long_prompts` long prompts (short answers) arrive one every
`interval_s`. Measured where a client sees them: the decodes' inter-token gaps (p50 / p99; the
gaps of the first phase are the baseline of the same setup) and the long prompts' time to first
token. The router decides per request (`pd_mode="auto"`): with a prefill worker it hands a long
prompt to it when the decode batch would lose more than the transfer costs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from cachesvc.workloads.pd import (
    ALONE,
    BLOCK_SIZE,
    NUM_WORKERS,
    SETUPS,
    WITH_PROMPTS,
    PDBenchArgs,
    PDRequest,
    PDShape,
    PhaseResult,
    format_results,
    phase_requests,
    warmup_request,
    worker_warmup_request,
)
from cachesvc.workloads.requests import greedy_request


async def _stream(
    stub: Any, ids: Sequence[int], max_tokens: int, request_id: str | None = None
) -> tuple[list[float], Any]:
    """Arrival times of the stream's messages (from the call), and its usage."""
    request = greedy_request(ids, max_tokens, "bench-pd")
    if request_id:
        request.request_id = request_id
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    async for message in stub.Generate(request):
        if message.token_ids:
            stamps.append(time.perf_counter() - start)
        if message.HasField("usage"):
            usage = message.usage
    return stamps, usage


async def _send_at(
    stub: Any, request: PDRequest, start: float, request_id: str
) -> tuple[list[float], Any]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start + request.offset_s - loop.time()))
    return await _stream(stub, request.prompt_ids, request.max_tokens, request_id)


class _Decisions(logging.Handler):
    """The router's reason for each request's mode (`pd_reason` of its request log line), by
    request id, while attached to the `router.requests` logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        fields = vars(record)
        if fields.get("pd_reason"):
            self.reasons[str(fields.get("request_id"))] = str(fields["pd_reason"])


async def _phase(
    stub: Any,
    shape: PDShape,
    setup: str,
    phase: str,
    vocab: int,
    decisions: _Decisions | None = None,
) -> PhaseResult:
    """Send the phase's requests (`pd_workload.phase_requests`) at their offsets; `decisions`
    collects the router's reasons (none without)."""
    decisions = decisions or _Decisions()
    requests = phase_requests(shape, phase, vocab)
    ids = [f"bench-pd-{uuid.uuid4().hex[:8]}" for _ in requests]
    start = asyncio.get_running_loop().time()
    sends = [_send_at(stub, r, start, i) for r, i in zip(requests, ids, strict=True)]
    done = await asyncio.gather(*sends)
    result = PhaseResult(setup, phase)
    for request, request_id, (stamps, usage) in zip(requests, ids, done, strict=True):
        if not request.long:
            result.gaps_s += [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
            continue
        result.ttft_s.append(stamps[0])
        result.decisions.append(decisions.reasons.get(request_id, ""))
        if usage is not None:
            result.worker_ttft_s.append(usage.ttft_ms / 1e3)
        if usage is not None and usage.prefill_worker_id:
            result.disaggregated += 1
            result.kv_moved_tokens += usage.kv_transfer_tokens
            if len(stamps) > 1:
                result.handoff_s.append(stamps[1] - stamps[0])
    return result


async def _run_setup(
    actors: dict[Any, Any], model: str, args: PDBenchArgs, setup: str
) -> list[PhaseResult]:
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.grpc.server import RouterServer

    config = RouterConfig(
        port=0,
        response_cache_mb=0,
        pd_mode=args.pd_mode,
        pd_itl_slo_ms=args.itl_slo_ms,
        pd_prefetch=args.prefetch,
    )
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    vocab = router.pool.model.vocab_size
    await _warm_workers(actors, worker_warmup_request(vocab))
    decisions = _Decisions()
    requests_log = logging.getLogger("router.requests")
    level = requests_log.level
    requests_log.addHandler(decisions)
    requests_log.setLevel(logging.INFO)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            warmup = warmup_request(vocab)
            await _stream(stub, warmup.prompt_ids, warmup.max_tokens)
            results = []
            for phase in (ALONE, WITH_PROMPTS):
                before = await _transfer_counters(actors)
                result = await _phase(stub, args.shape, setup, phase, vocab, decisions)
                after = await _transfer_counters(actors)
                prefetched, early = (int(after[k] - before[k]) for k in _TRANSFER_COUNTERS)
                result.prefetched_tokens, result.early_chunks = BLOCK_SIZE * prefetched, early
                results.append(result)
            return results
    finally:
        requests_log.removeHandler(decisions)
        requests_log.setLevel(level)
        await server.stop(grace_s=1.0)
        await router.close()


# The workers' counters of early pulls: blocks landed by decode workers, chunks prefill workers
# sent before their prompt was all computed.
_TRANSFER_COUNTERS = ("peer_prefetched_blocks", "peer_held_early_chunks")


async def _transfer_counters(actors: dict[Any, Any]) -> dict[str, float]:
    """The workers' `_TRANSFER_COUNTERS`, summed (`WorkerActor.stats`)."""
    loads = await asyncio.gather(*(actor.stats.remote() for actor in actors.values()))
    return {k: sum(load.tiering.get(k, 0.0) for load in loads) for k in _TRANSFER_COUNTERS}


async def _warm_workers(actors: dict[Any, Any], request: PDRequest) -> None:
    """Each worker computes `request` (sent to it directly, one after the other), then forgets
    it: what it learnt of its prefill cost stays, its cache holds nothing of the phases."""
    params = {"max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True}
    for actor in actors.values():
        stream = actor.generate.options(num_returns="streaming").remote(
            list(request.prompt_ids), params, f"bench-pd-warm-{uuid.uuid4().hex[:8]}", None
        )
        async for ref in stream:
            await ref
        await actor.flush.remote()


def measure_pd(args: PDBenchArgs) -> list[PhaseResult]:
    """Run both setups over real workers (blocking); what the client saw in each phase."""
    from cachesvc.bench.live import bench_model, local_ray
    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig

    results: list[PhaseResult] = []
    with bench_model(args.model, args.tiny) as model, local_ray():
        engine = EngineConfig.from_env(
            model=model,
            block_size=BLOCK_SIZE,
            num_blocks=args.shape.num_blocks,
            num_threads=1,
            peer_pull=True,
        )
        for setup, (num_prefill, num_decode) in SETUPS.items():
            namespace = f"bench-pd-{uuid.uuid4().hex[:6]}"
            group = WorkerGroup(
                engine,
                NUM_WORKERS,
                namespace=namespace,
                device="cpu",
                num_prefill=num_prefill,
                num_decode=num_decode,
                prefill_chunk_tokens=args.prefill_chunk_tokens,
            )
            actors = spawn_workers(group)
            try:
                print(f"{setup}: running", file=sys.stderr)
                results += asyncio.run(_run_setup(actors, model, args, setup))
            finally:
                stop_workers(actors)
    return results


def run_pd_bench(args: PDBenchArgs) -> int:
    """Blocking entry point of `cachesvc bench pd`; prints the table, returns 0."""
    results = measure_pd(args)
    print(format_results(results))
    if args.json_path:
        import json
        from pathlib import Path

        Path(args.json_path).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0
