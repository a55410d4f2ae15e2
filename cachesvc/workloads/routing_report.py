"""What `cachesvc bench routing` reports: each request as the client saw it, each policy's
summary of its requests, and those summaries as a table, JSON and plots."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.workloads.table import format_table, percentile


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it."""

    worker: str
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    pulled_tokens: int = 0  # of `cached_tokens`, pulled from another worker


@dataclass(frozen=True)
class PolicyResult:
    """One policy's run on one workload, summed up from its requests' records."""

    policy: str
    workload: str
    num_requests: int
    num_errors: int
    hit_ratio: float
    computed_tokens: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_tok_s: float
    imbalance: float  # max / mean requests per worker; 1.0 is perfectly even
    requests_per_worker: Mapping[str, int]
    pulled_tokens: int = 0  # prompt tokens pulled from another worker
    pulled_mb: float = 0.0  # KV bytes the workers pulled from each other


def summarize(
    policy: str,
    workload: str,
    records: Sequence[RequestRecord],
    workers: Sequence[str],
    num_errors: int,
    wall_s: float,
    pulled_bytes: int = 0,
) -> PolicyResult:
    """Aggregate the records of one policy's run (pure)."""
    per_worker = {w: 0 for w in workers}
    for r in records:
        per_worker[r.worker] = per_worker.get(r.worker, 0) + 1
    mean = statistics.fmean(per_worker.values()) if per_worker else 0.0
    prompt = sum(r.prompt_tokens for r in records)
    ttfts = [r.ttft_s * 1e3 for r in records]
    return PolicyResult(
        policy=policy,
        workload=workload,
        num_requests=len(records),
        num_errors=num_errors,
        hit_ratio=sum(r.cached_tokens for r in records) / prompt if prompt else 0.0,
        computed_tokens=sum(r.computed_tokens for r in records),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        throughput_tok_s=sum(r.output_tokens for r in records) / wall_s if wall_s > 0 else 0.0,
        imbalance=max(per_worker.values()) / mean if mean else 0.0,
        requests_per_worker=per_worker,
        pulled_tokens=sum(r.pulled_tokens for r in records),
        pulled_mb=pulled_bytes / 2**20,
    )


def to_json(result: PolicyResult) -> dict[str, Any]:
    out = dataclasses.asdict(result)
    out["requests_per_worker"] = dict(result.requests_per_worker)
    return out


def format_results(results: Sequence[PolicyResult]) -> str:
    headers = ["policy", "hit ratio", "computed tok", "TTFT p50 ms", "TTFT p99 ms"]
    headers += ["tok/s", "imbalance", "errors"]
    pulls = any(r.pulled_tokens for r in results)
    if pulls:
        headers += ["pulled tok", "pulled MiB"]
    rows = [
        [
            r.policy,
            r.hit_ratio,
            r.computed_tokens,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            r.throughput_tok_s,
            r.imbalance,
            r.num_errors,
            *([r.pulled_tokens, r.pulled_mb] if pulls else []),
        ]
        for r in results
    ]
    return format_table(headers, rows)


def plot_results(results: Sequence[PolicyResult], path: str) -> None:
    """Bar charts into a PNG: one row per workload; hit ratio, prompt tokens computed, TTFT
    p50/p99 and load imbalance per policy."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(len(workloads), 4, figsize=(14, 3.2 * len(workloads)), squeeze=False)
    for row, workload in zip(axes, workloads, strict=True):
        _plot_row(row, [r for r in results if r.workload == workload], workload)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_row(axes: Any, results: Sequence[PolicyResult], workload: str) -> None:
    names = [r.policy for r in results]
    xs = list(range(len(names)))
    axes[0].bar(names, [r.hit_ratio for r in results], color="tab:green")
    axes[0].set_title(f"{workload}: prefix-cache hit ratio", fontsize=10)
    axes[1].bar(names, [r.computed_tokens for r in results], color="tab:orange")
    axes[1].set_title("prompt tokens computed", fontsize=10)
    axes[2].bar([x - 0.2 for x in xs], [r.ttft_p50_ms for r in results], 0.4, label="p50")
    axes[2].bar([x + 0.2 for x in xs], [r.ttft_p99_ms for r in results], 0.4, label="p99")
    axes[2].set_xticks(xs, names)
    axes[2].set_title("TTFT (ms)", fontsize=10)
    axes[2].legend(fontsize=8)
    axes[3].bar(names, [r.imbalance for r in results], color="tab:purple")
    axes[3].axhline(1.0, color="grey", linewidth=0.8)
    axes[3].set_title("load imbalance (max / mean requests)", fontsize=10)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
