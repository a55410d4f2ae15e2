"""`cachesvc bench admission`: a burst of requests past the workers' capacity, served without
and with admission (`router.admission`, the router's `admit_ttft_ms`).

Two real mixed workers on this machine (the default model, or a tiny one), behind a real
router and its gRPC door. The capacity is measured first: prompts sent one at a time, each
worker serves one per median time to first token, so two serve two. Then, in each setup, the
same warm-up requests (admission learns its scale from them) and the same burst: prompts of
their own arriving evenly for `seconds` at `overload` times that capacity, four tokens each
(at twice the capacity the queue grows by half a second a second, so the later ones wait far
past the target unless they are refused).
Measured where a client sees it: how many were refused (RESOURCE_EXHAUSTED), the served ones'
TTFT, and goodput: the requests whose first token came within the target, per second from the
first arrival to the last answer. The setups share the workers; each flushes them first.

With `--itl-ms` the answers are longer (32 tokens unless `--max-tokens`), goodput counts the
requests within both targets (TTFT, and the mean gap between their tokens), and a third setup
adds admission on the streams (`admit_itl_ms`): a mixed worker computing the burst's prompts
between its streams' tokens keeps them within the target only if it is not given more.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cachesvc.bench.pd import percentile
from cachesvc.bench.requests import greedy_request
from cachesvc.bench.table import format_table, write_json

NUM_WORKERS = 2
MAX_TOKENS = 4
STREAM_TOKENS = 32  # an answer's tokens with an inter-token target
WARMUPS = 3  # one at a time: the capacity, and what admission learns its scale from
WITHOUT, WITH, ON_STREAMS = "without admission", "with admission", "with admission on the streams"
SETUPS = (WITHOUT, WITH)


@dataclass(frozen=True)
class AdmissionBenchArgs:
    quick: bool = False
    model: str | None = None
    tiny: bool = False
    json_path: str | None = None
    ttft_ms: float = 3000.0  # the TTFT target, and admission's `admit_ttft_ms`
    overload: float = 2.0  # the burst's arrival rate over the measured capacity
    seconds: float | None = None  # of arrivals (default 20, quick 10)
    prompt_len: int | None = None  # tokens per prompt (default 384, quick 192)
    # The inter-token target (each request's mean gap), and admission's `admit_itl_ms` in a
    # third setup; None: TTFT alone, four-token answers.
    itl_ms: float | None = None
    max_tokens: int | None = None  # an answer's tokens (default 4; with itl_ms, 32)

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.overload <= 0:
            raise ValueError("--ttft-ms and --overload must be positive")
        if (self.itl_ms is not None and self.itl_ms <= 0) or (
            self.max_tokens is not None and self.max_tokens < 1
        ):
            raise ValueError("--itl-ms must be positive and --max-tokens >= 1")
        if (self.seconds is not None and self.seconds <= 0) or (
            self.prompt_len is not None and self.prompt_len < 2
        ):
            raise ValueError("--seconds must be positive and --prompt-len >= 2")

    @property
    def duration_s(self) -> float:
        return self.seconds or (10.0 if self.quick else 20.0)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len or (192 if self.quick else 384)

    @property
    def answer_tokens(self) -> int:
        return self.max_tokens or (MAX_TOKENS if self.itl_ms is None else STREAM_TOKENS)

    @property
    def setups(self) -> tuple[str, ...]:
        return SETUPS if self.itl_ms is None else (*SETUPS, ON_STREAMS)

    def targets(self, setup: str) -> tuple[float | None, float | None]:
        """A setup's admission targets (ms): `admit_ttft_ms`, `admit_itl_ms` (None: off)."""
        ttft = None if setup == WITHOUT else self.ttft_ms
        return ttft, self.itl_ms if setup == ON_STREAMS else None


@dataclass
class SetupResult:
    """One setup's burst, as its client saw it."""

    setup: str
    offered_rps: float
    ttft_target_ms: float
    ttft_s: list[float] = field(default_factory=list)  # the served requests'
    refused: int = 0
    span_s: float = 0.0  # from the first arrival to the last answer (or refusal)
    itl_target_ms: float | None = None  # None: goodput counts the TTFT alone
    itl_s: list[float] = field(default_factory=list)  # the served requests' mean gaps

    @property
    def num_requests(self) -> int:
        return len(self.ttft_s) + self.refused

    @property
    def within(self) -> int:
        """Served requests within the targets."""
        itl = self.itl_s or [0.0] * len(self.ttft_s)
        ttft_ok = [t * 1e3 <= self.ttft_target_ms for t in self.ttft_s]
        itl_ok = [self.itl_target_ms is None or g * 1e3 <= self.itl_target_ms for g in itl]
        return sum(a and b for a, b in zip(ttft_ok, itl_ok, strict=True))

    @property
    def goodput_rps(self) -> float:
        return self.within / self.span_s if self.span_s > 0 else 0.0

    def row(self, baseline_rps: float | None) -> list[Any]:
        ratio = f"{self.goodput_rps / baseline_rps:.2f}x" if baseline_rps else "-"
        return [
            self.setup,
            self.offered_rps,
            self.num_requests,
            self.refused,
            self.within,
            percentile(self.ttft_s, 50) * 1e3,
            percentile(self.ttft_s, 99) * 1e3,
            percentile(self.itl_s, 50) * 1e3 if self.itl_s else "-",
            percentile(self.itl_s, 99) * 1e3 if self.itl_s else "-",
            self.goodput_rps,
            ratio,
        ]


def prompt(index: int, num_tokens: int, vocab: int) -> list[int]:
    """A prompt of its own (nothing shared with any other index)."""
    rng = random.Random(f"bench-admission-{index}")
    return [rng.randrange(3, vocab - 1) for _ in range(num_tokens)]


async def _send(
    stub: Any, ids: Sequence[int], delay_s: float, max_tokens: int
) -> tuple[float, float] | None:
    """The request's TTFT and mean gap between its tokens (s), or None when it was refused;
    other errors are raised."""
    import grpc

    await asyncio.sleep(delay_s)
    request = greedy_request(ids, max_tokens, "bench-admission")
    start = time.perf_counter()
    times: list[float] = []
    try:
        async for message in stub.Generate(request):
            times += [time.perf_counter() - start] * len(message.token_ids)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None
    assert times, "a served request has a first token"
    return times[0], mean_gap_s(times)


def mean_gap_s(times: Sequence[float]) -> float:
    """The mean gap between consecutive token times (0.0 for one token)."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0


async def _run_setup(
    actors: dict[Any, Any], model: str, args: AdmissionBenchArgs, setup: str, rate: float | None
) -> tuple[SetupResult, float]:
    """One setup's burst (at `rate` requests/s; None: measure the capacity first), and the
    capacity it ran at."""
    import grpc

    from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
    from router.bootstrap import build_router
    from router.config import RouterConfig
    from router.server import RouterServer

    ttft_ms, itl_ms = args.targets(setup)
    config = RouterConfig(port=0, response_cache_mb=0, admit_ttft_ms=ttft_ms, admit_itl_ms=itl_ms)
    await asyncio.gather(*(actor.flush.remote() for actor in actors.values()))
    router = await build_router(actors, config, model)
    server = RouterServer(router, config)
    await server.start()
    vocab = router.pool.model.vocab_size
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            warm = []
            for i in range(WARMUPS):  # one at a time: each alone on a worker
                sent = await _send(stub, prompt(-1 - i, args.num_tokens, vocab), 0.0, MAX_TOKENS)
                if sent is None:
                    raise RuntimeError(
                        f"--ttft-ms {args.ttft_ms:g} is below what a request takes alone here: "
                        "admission refuses even an idle cluster's"
                    )
                warm.append(sent[0])
            if rate is None:
                rate = args.overload * NUM_WORKERS / statistics.median(warm)
            result = SetupResult(setup, rate, args.ttft_ms, itl_target_ms=args.itl_ms)
            start = time.perf_counter()
            sends = [
                _send(stub, prompt(i, args.num_tokens, vocab), i / rate, args.answer_tokens)
                for i in range(max(1, round(args.duration_s * rate)))
            ]
            for sent in await asyncio.gather(*sends):
                if sent is None:
                    result.refused += 1
                else:
                    result.ttft_s.append(sent[0])
                    result.itl_s.append(sent[1])
            result.span_s = time.perf_counter() - start
            return result, rate
    finally:
        await server.stop(grace_s=1.0)
        await router.close()


def measure_admission(args: AdmissionBenchArgs) -> list[SetupResult]:
    """Both setups over the same two real workers (blocking)."""
    import tempfile
    from pathlib import Path

    import ray

    from cachesvc.config import EngineConfig
    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.text.default_model import default_model_path

    results: list[SetupResult] = []
    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-admission-") as tmp:
        model = args.model or str(default_model_path())
        if args.tiny:
            from workers.model.tiny import write_tiny_model

            model = str(write_tiny_model(Path(tmp) / "tiny-llama", vocab_size=512))
        engine = EngineConfig.from_env(model=model, num_threads=1)
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        try:
            namespace = f"bench-admission-{uuid.uuid4().hex[:6]}"
            group = WorkerGroup(engine, NUM_WORKERS, namespace=namespace, device="cpu")
            actors = spawn_workers(group)
            try:
                rate = None
                for setup in args.setups:
                    print(f"{setup}: running", file=sys.stderr)
                    result, rate = asyncio.run(_run_setup(actors, model, args, setup, rate))
                    results.append(result)
            finally:
                stop_workers(actors)
        finally:
            ray.shutdown()
    return results


def format_results(results: Sequence[SetupResult]) -> str:
    headers = ["setup", "offered req/s", "requests", "refused", "within targets"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "mean ITL p50 ms", "mean ITL p99 ms"]
    headers += ["goodput req/s", "vs without"]
    baseline = results[0].goodput_rps if results else None
    rows = [r.row(None if i == 0 else baseline) for i, r in enumerate(results)]
    target = results[0].ttft_target_ms if results else 0.0
    itl = results[0].itl_target_ms if results else None
    targets = f"TTFT target {target:g} ms (admission's admit_ttft_ms)"
    if itl is not None:
        targets += f", mean ITL target {itl:g} ms (admit_itl_ms, in the last setup)"
    return format_table(headers, rows) + (
        f"\n\n{targets}; goodput: requests served within the targets per second, from the "
        "first arrival to the last answer"
    )


def run_admission_bench(args: AdmissionBenchArgs) -> int:
    """Blocking entry point of `cachesvc bench admission`; prints the table, returns 0."""
    results = measure_admission(args)
    print(format_results(results))
    write_json(args.json_path, [{**asdict(r), "goodput_rps": r.goodput_rps} for r in results])
    return 0
