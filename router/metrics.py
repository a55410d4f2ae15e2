"""Prometheus metrics of one router, and the HTTP endpoint that serves them.

Each router owns a `CollectorRegistry` (not the process-global one), so several routers in one
process — tests, the routing benchmark — count separately. Counters and histograms are updated
on the request path; per-worker gauges (queue depth, blocks per tier, indexed blocks) are read
from the pool when scraped, so they are never stale and cost nothing between scrapes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from router.domain import TenantUsage
    from router.pool.worker_pool import WorkerPool
    from router.response_cache.store import StoreStats
    from workers.protocol import Usage

_request_log = logging.getLogger("router.requests")

# Seconds; CPU workers with long prompts reach tens of seconds, GPU ones stay in milliseconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    """Every metric of one router. Mutators never raise and never block."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "cachesvc_requests",
            "Requests by door (grpc, http), method and final status (gRPC's status names on "
            "both doors)",
            ["door", "method", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "cachesvc_ttft_seconds",
            "Time from a Generate call's arrival to its first token, seen by the router",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "cachesvc_request_latency_seconds",
            "Time from a Generate call's arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "cachesvc_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "cachesvc_cached_tokens", "Prompt tokens served from a cache tier", ["tier"], registry=r
        )
        self.computed_tokens = Counter(
            "cachesvc_computed_tokens", "Prompt tokens the workers computed", registry=r
        )
        self.completion_tokens = Counter(
            "cachesvc_completion_tokens", "Tokens generated", registry=r
        )
        self.decisions = Counter(
            "cachesvc_routing_decisions",
            "Requests routed, by policy and chosen worker",
            ["policy", "worker"],
            registry=r,
        )
        self.pull_hints = Counter(
            "cachesvc_pull_hints",
            "Requests sent with a holder a worker may pull the prefix from",
            registry=r,
        )
        self.retries = Counter(
            "cachesvc_retries",
            "Requests sent again: before_start (never started) or mid_stream (resumed)",
            ["kind"],
            registry=r,
        )
        self.refused = Counter(
            "cachesvc_refused",
            "Requests refused by admission: predicted to start later than admit_ttft_ms, or to "
            "join streams decoding slower than admit_itl_ms",
            registry=r,
        )
        self.pd_decisions = Counter(
            "cachesvc_pd_decisions",
            "Requests planned with prefill workers present: colocated or disaggregated",
            ["mode"],
            registry=r,
        )
        self.pd_fallbacks = Counter(
            "cachesvc_pd_fallbacks",
            "Disaggregated requests whose prefill worker failed (before or after its token)",
            ["reason"],
            registry=r,
        )
        self.pd_error = Histogram(
            "cachesvc_pd_measured_over_predicted",
            "Disaggregation's predictions checked: measured over predicted time to the first "
            "token (ttft) and from the first token to the decode worker's (handoff)",
            ["phase"],
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2, 4),
            registry=r,
        )
        self.retained_tokens = Counter(
            "cachesvc_retained_tokens",
            "Prompt tokens retained at their request's ask (retained), and those its tenant's "
            "retention budget trimmed (trimmed)",
            ["outcome"],
            registry=r,
        )
        self.tenant_blocks = Gauge(
            "cachesvc_tenant_blocks",
            "KV blocks per tenant and tier, summed over the workers: cached and, of those, "
            "retained; as of the last Admin.TenantUsage call",
            ["tenant", "tier", "state"],
            registry=r,
        )
        self._hits: dict[str, float] = {}
        self._prompt_total = 0.0
        self._lock = threading.Lock()  # scrapes run on the HTTP server's thread

    def watch_response_cache(self, stats: StoreStats) -> None:
        """Export the response cache's counters at scrape time (call once)."""
        self.registry.register(_ResponseCacheCollector(stats))

    def watch(self, pool: WorkerPool) -> None:
        """Export the pool's per-worker state at scrape time (call once)."""
        self.registry.register(_PoolCollector(pool, self))

    def record_tenant_usage(self, usage: list[TenantUsage]) -> None:
        """Set the tenant gauges to a fresh sum over the workers (tenants gone are dropped)."""
        self.tenant_blocks.clear()
        for entry in usage:
            for tier, (cached, retained) in entry.tiers.items():
                self.tenant_blocks.labels(entry.tenant, tier, "cached").set(cached)
                self.tenant_blocks.labels(entry.tenant, tier, "retained").set(retained)

    def record_usage(self, usage: Usage) -> None:
        """Token counters of one finished sample."""
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.computed_tokens.inc(usage.computed_tokens)
        if usage.retained_tokens:
            self.retained_tokens.labels("retained").inc(usage.retained_tokens)
        if usage.retention_trimmed_tokens:
            self.retained_tokens.labels("trimmed").inc(usage.retention_trimmed_tokens)
        self.completion_tokens.inc(usage.completion_tokens)
        with self._lock:
            self._prompt_total += usage.prompt_tokens
            for tier, num in usage.cached_tokens.items():
                self.cached_tokens.labels(tier).inc(num)
                self._hits[tier] = self._hits.get(tier, 0.0) + num

    def hit_ratios(self) -> dict[str, float]:
        """Cached prompt tokens over all prompt tokens, per tier."""
        with self._lock:
            total = self._prompt_total
            return {tier: (hits / total if total else 0.0) for tier, hits in self._hits.items()}


@dataclass
class RequestOutcome:
    """One Generate call as metrics and the request log see it; mutated by the router."""

    request_id: str
    policy: str
    status: str = "error"  # ok | invalidinput | exhausted | unavailable | cancelled | ...
    num_resumes: int = 0
    started_s: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    worker: str | None = None
    route_reason: str = ""  # the policy's, of the last attempt
    pulled_tokens: int = 0  # prompt tokens pulled from another worker
    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    completion_tokens: int = 0
    # Prefill/decode disaggregation (`router.request.disagg`): the mode chosen, the prefill worker
    # of a disaggregated request, predicted and measured times.
    pd_mode: str | None = None
    pd_reason: str | None = None  # why: `PDDecision.reason` (the route reason is the worker's)
    prefill_worker: str | None = None
    pd_predicted_ttft_ms: float | None = None
    admit_predicted_s: float | None = None  # admission's raw prediction, when it admitted it
    # Admission's prediction of the TTFT as it judged it (scaled), beside the measured `ttft_ms`.
    admit_predicted_ttft_ms: float | None = None
    pd_predicted_handoff_ms: float | None = None
    pd_handoff_ms: float | None = None

    def first_token(self, metrics: RouterMetrics) -> None:
        """Call on every delta with tokens; only the first is timed."""
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started_s
            metrics.ttft.observe(self.ttft_s)
            if self.pd_predicted_ttft_ms:
                metrics.pd_error.labels("ttft").observe(
                    self.ttft_s * 1e3 / self.pd_predicted_ttft_ms
                )

    def usage(self, usage: Usage) -> None:
        """Add one finished sample's usage."""
        self.worker = usage.worker_id
        self.prefill_worker = usage.prefill_worker_id
        self.prompt_tokens = usage.prompt_tokens
        self.cached_tokens += sum(usage.cached_tokens.values())
        self.pulled_tokens += usage.cached_tokens.get("peer", 0)
        self.computed_tokens += usage.computed_tokens
        self.completion_tokens += usage.completion_tokens

    def done(self, metrics: RouterMetrics) -> None:
        """Observe the latency of a completed stream and write the request's log line."""
        latency_s = time.perf_counter() - self.started_s
        if self.status == "ok":
            metrics.latency.observe(latency_s)
        _request_log.info(
            "request finished",
            extra={
                "request_id": self.request_id,
                "status": self.status,
                "policy": self.policy,
                "worker": self.worker,
                "route_reason": self.route_reason,
                "prompt_tokens": self.prompt_tokens,
                "pulled_tokens": self.pulled_tokens,
                "cached_tokens": self.cached_tokens,
                "computed_tokens": self.computed_tokens,
                "completion_tokens": self.completion_tokens,
                "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1e3, 2),
                "latency_ms": round(latency_s * 1e3, 2),
                "num_resumes": self.num_resumes,
                "pd_mode": self.pd_mode,
                "pd_reason": self.pd_reason,
                "prefill_worker": self.prefill_worker,
                "pd_predicted_ttft_ms": self.pd_predicted_ttft_ms,
                "pd_predicted_handoff_ms": self.pd_predicted_handoff_ms,
                "pd_handoff_ms": self.pd_handoff_ms,
                "admit_predicted_ttft_ms": self.admit_predicted_ttft_ms,
            },
        )


class _PoolCollector:
    """Gauges read from the worker pool when Prometheus scrapes."""

    def __init__(self, pool: WorkerPool, metrics: RouterMetrics) -> None:
        self._pool = pool
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # names are only known at scrape time; skip registry duplicate checks

    def collect(self) -> Iterator[Metric]:
        hit = GaugeMetricFamily(
            "cachesvc_cache_hit_ratio", "Cached prompt tokens / prompt tokens", labels=["tier"]
        )
        for tier, ratio in sorted(self._metrics.hit_ratios().items()):
            hit.add_metric([tier], ratio)
        yield hit
        gauges = {
            name: GaugeMetricFamily(f"cachesvc_worker_{name}", doc, labels=["worker"])
            for name, doc in _WORKER_GAUGES.items()
        }
        blocks = GaugeMetricFamily(
            "cachesvc_worker_blocks",
            "KV blocks per worker and tier: total, used (running requests), cached (reusable)",
            labels=["worker", "tier", "state"],
        )
        for state in list(self._pool.states()):  # a copy: the loop thread may mutate it
            worker = str(state.worker_id)
            values = {
                "up": 1.0 if state.health.value == "healthy" else 0.0,
                "queue_depth": state.num_requests,
                "inflight": state.num_inflight,
                "queued_tokens": state.num_queued_tokens,
                "indexed_blocks": self._pool.index.num_blocks(state.worker_id),
            }
            for name, value in values.items():
                gauges[name].add_metric([worker], float(value))
            for tier, tb in dict(state.load.blocks).items():
                for kind in ("total", "used", "cached"):
                    blocks.add_metric([worker, tier, kind], float(getattr(tb, kind)))
        yield from gauges.values()
        yield blocks
        yield from _tiering_families(list(self._pool.states()))
        resyncs = CounterMetricFamily(
            "cachesvc_index_resyncs", "Prefix index resyncs from a worker snapshot"
        )
        resyncs.add_metric([], float(self._pool.num_resyncs))
        yield resyncs
        unknown = CounterMetricFamily(
            "cachesvc_index_epoch_unknown",
            "Requests given a salt of their own (reusing no cached block): the shared index "
            "could not tell the purge epoch",
        )
        unknown.add_metric([], float(self._pool.index.num_epoch_unknown))
        yield unknown


_PLAN_TIMING = re.compile(r"^plan_(?P<kind>[a-z]+)_(?P<what>timed|predicted_s|actual_s)$")


def _tiering_families(states: list[Any]) -> Iterator[Metric]:
    """The workers' tier counters (`KVTiering.metrics`): timed plans with their predicted and
    measured seconds (rate(actual) / rate(predicted) is how far the cost model is off), and
    every other counter (tier hits, misses, bytes, moves) by name."""
    plans = CounterMetricFamily(
        "cachesvc_worker_plans_timed",
        "Load plans timed to the end of their prompt, per worker and kind",
        labels=["worker", "kind"],
    )
    seconds = CounterMetricFamily(
        "cachesvc_worker_plan_seconds",
        "Sum of the predicted and of the measured time of timed load plans",
        labels=["worker", "kind", "time"],
    )
    other = CounterMetricFamily(
        "cachesvc_worker_tiering",
        "Lower-tier counters per worker: <tier>_<hits|misses|bytes_read|...>, plan_<kind>, "
        "demoted, dropped, shared, loaded_blocks, failed_blocks",
        labels=["worker", "counter"],
    )
    for state in states:
        worker = str(state.worker_id)
        for name, value in sorted(dict(state.load.tiering).items()):
            match = _PLAN_TIMING.match(name)
            if match is None:
                other.add_metric([worker, name], float(value))
            elif match["what"] == "timed":
                plans.add_metric([worker, match["kind"]], float(value))
            else:
                time_kind = match["what"].removesuffix("_s")
                seconds.add_metric([worker, match["kind"], time_kind], float(value))
    yield from (plans, seconds, other)


_WORKER_GAUGES = {
    "up": "1 while the worker is healthy",
    "queue_depth": "Requests running or waiting on the worker",
    "inflight": "Requests this router has forwarded and not seen finish",
    "queued_tokens": "Tokens still to compute ahead of a new request",
    "indexed_blocks": "Blocks the prefix index attributes to the worker",
}


class MetricsHttpServer:
    """Serves `registry` as Prometheus text on http://host:port/metrics (port 0: any free one)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._server: Any
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class _ResponseCacheCollector:
    """The response cache's counters, read when Prometheus scrapes."""

    def __init__(self, stats: StoreStats) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self._stats
        for name, doc, value in (
            ("hits", "Requests answered from the response cache", s.hits),
            ("misses", "Cacheable requests the response cache could not answer", s.misses),
            ("stores", "Answers stored", s.stores),
            ("evictions", "Answers evicted to make room (memory store)", s.evictions),
            ("errors", "Response cache store errors (each a miss)", s.errors),
            (
                "rejected",
                "Entries read back that failed authentication or validation (each a miss)",
                s.rejected,
            ),
            ("dropped", "Answers not stored: the write queue was full", s.dropped),
            ("too_large", "Answers not stored: over the entry size limit", s.too_large),
            (
                "skipped",
                "Store calls not made: Redis down (breaker open or not connected), or every "
                "lookup connection busy",
                s.skipped,
            ),
            ("breaker_opens", "Times the response store's breaker opened", s.breaker_opens),
        ):
            yield CounterMetricFamily(f"cachesvc_response_cache_{name}", doc, value=value)
        yield GaugeMetricFamily(
            "cachesvc_response_cache_bytes", "Bytes held (memory store)", value=s.bytes
        )
        yield GaugeMetricFamily(
            "cachesvc_response_cache_entries", "Answers held (memory store)", value=s.entries
        )
        if s.redis_up is not None:
            yield GaugeMetricFamily(
                "cachesvc_response_cache_redis_up",
                "1 while the response cache's lookup connections to Redis are open; 0 while "
                "it (re)connects in the background and every lookup is a miss",
                value=float(s.redis_up),
            )
