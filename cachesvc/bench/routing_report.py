"""Tables, JSON and plots of `cachesvc bench routing` results."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachesvc.bench.table import format_table

if TYPE_CHECKING:
    from cachesvc.bench.routing import PolicyResult


def to_json(result: PolicyResult) -> dict[str, Any]:
    out = dataclasses.asdict(result)
    out["requests_per_worker"] = dict(result.requests_per_worker)
    return out


def format_results(results: Sequence[PolicyResult]) -> str:
    headers = ["policy", "hit ratio", "computed tok", "TTFT p50 ms", "TTFT p99 ms"]
    headers += ["tok/s", "imbalance", "errors"]
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
