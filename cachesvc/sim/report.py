"""What `cachesvc simulate` reports per policy: hit ratio by tier against the oracle, TTFT,
throughput, busy-time imbalance, what workers pulled from each other and the policy's decisions
by reason; as a table, JSON and a plot."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.sim.loop import SimRun
from cachesvc.sim.trace import SimRequest, oracle_hit_blocks
from cachesvc.workloads.table import format_table, percentile
from router.policy.routing import PEER


@dataclass(frozen=True)
class SimSummary:
    """One policy's replay of one trace on one cluster, summed up."""

    policy: str  # "+pull" when workers pulled from each other
    label: str  # what varies in a sweep ("workers=8", "capacity=0.05"), else ""
    num_requests: int
    num_rejected: int
    hit_ratio: float  # cached prompt tokens / prompt tokens, every tier
    hit_by_tier: Mapping[str, float]
    oracle_hit_ratio: float
    ratio_to_oracle: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    throughput_tok_s: float  # output tokens per second of the makespan
    pulled_tokens: int  # prompt tokens pulled from a holder (the "peer" part of the hits)
    pulled_mib: float  # KV the workers pulled from each other (requests preempted later too)
    busy_imbalance: float  # max / mean busy seconds per worker; 1.0 is even
    num_preemptions: int
    makespan_s: float  # from the first arrival to the last request's end
    decisions: Mapping[str, int]  # policy reason -> decisions
    plans: Mapping[str, int]  # the planner's choices (with lower tiers)
    wall_s: float  # how long the simulation itself ran


def oracle_ratio(requests: Sequence[SimRequest]) -> float:
    """The hit ratio of one infinite cache that has seen every earlier request."""
    prompt = sum(r.prompt_len for r in requests)
    hits = oracle_hit_blocks(requests)
    cached = sum(n * r.block_size for n, r in zip(hits, requests, strict=True))
    return cached / prompt if prompt else 0.0


def summarize(
    run: SimRun, requests: Sequence[SimRequest], label: str = "", oracle: float | None = None
) -> SimSummary:
    """Aggregate a replay (pure); `oracle` may be passed when already computed."""
    oracle = oracle_ratio(requests) if oracle is None else oracle
    done = [s for s in run.seqs if s.finish_s is not None]
    assert len(done) == len(run.seqs), "every routed request finishes"
    prompt = sum(s.req.prompt_len for s in done)
    by_tier: dict[str, float] = {}
    for s in done:
        for tier, tokens in s.cached.items():
            by_tier[tier] = by_tier.get(tier, 0.0) + tokens
    by_tier = {t: v / prompt for t, v in sorted(by_tier.items())} if prompt else {}
    hit = sum(by_tier.values())
    ttfts = [
        (s.first_token_s - s.req.arrival_s) * 1e3 for s in done if s.first_token_s and s.req.timed
    ]
    busy = [w.busy_s for w in run.workers]
    mean_busy = statistics.fmean(busy)
    makespan = max((s.finish_s or 0.0) for s in done) if done else 0.0
    output = sum(s.req.output_len for s in done)
    plans: dict[str, int] = {}
    for w in run.workers:
        for kind, n in w.plans.items():
            plans[kind] = plans.get(kind, 0) + n
    return SimSummary(
        policy=run.label,
        label=label,
        num_requests=len(done),
        num_rejected=run.num_rejected,
        hit_ratio=hit,
        hit_by_tier=by_tier,
        oracle_hit_ratio=oracle,
        ratio_to_oracle=hit / oracle if oracle else 0.0,
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p99_ms=percentile(ttfts, 99),
        throughput_tok_s=output / makespan if makespan > 0 else 0.0,
        pulled_tokens=sum(s.cached.get(PEER, 0) for s in done),
        pulled_mib=sum(w.loads.pulled_bytes for w in run.workers) / 2**20,
        busy_imbalance=max(busy) / mean_busy if mean_busy else 0.0,
        num_preemptions=sum(s.num_preemptions for s in done),
        makespan_s=makespan,
        decisions=dict(run.reasons.most_common()),
        plans=plans,
        wall_s=run.wall_s,
    )


def to_json(summary: SimSummary) -> dict[str, Any]:
    out = dataclasses.asdict(summary)
    out["hit_by_tier"] = dict(summary.hit_by_tier)
    out["decisions"] = dict(summary.decisions)
    out["plans"] = dict(summary.plans)
    return out


def format_summaries(summaries: Sequence[SimSummary]) -> str:
    """The main table, then each policy's decisions by reason."""
    tiers = sorted({t for s in summaries for t in s.hit_by_tier})
    headers = ["run", "policy", "hit", *[f"hit {t}" for t in tiers], "oracle", "/oracle"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "tok/s"]
    pulls = any(s.pulled_mib for s in summaries)
    if pulls:
        headers += ["pulled tok", "pulled MiB"]
    headers += ["busy imb", "preempt", "sim s"]
    rows = [
        [
            s.label or "-",
            s.policy,
            s.hit_ratio,
            *[s.hit_by_tier.get(t, 0.0) for t in tiers],
            s.oracle_hit_ratio,
            s.ratio_to_oracle,
            s.ttft_p50_ms,
            s.ttft_p99_ms,
            s.throughput_tok_s,
            *([s.pulled_tokens, s.pulled_mib] if pulls else []),
            s.busy_imbalance,
            s.num_preemptions,
            s.wall_s,
        ]
        for s in summaries
    ]
    lines = [format_table(headers, rows), "", "decisions by reason:"]
    for s in summaries:
        where = f"{s.label} " if s.label else ""
        reasons = ", ".join(f"{n} {reason}" for reason, n in s.decisions.items())
        lines.append(f"  {where}{s.policy}: {reasons}")
    return "\n".join(lines)


def plot_summaries(summaries: Sequence[SimSummary], path: str) -> None:
    """Ratio to the oracle, TTFT p50/p99 and busy imbalance per policy, one line per policy
    over the sweep's runs (bars when there is one run)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(s.label or "-" for s in summaries))
    policies = list(dict.fromkeys(s.policy for s in summaries))
    metrics = [
        ("ratio_to_oracle", "hit ratio / oracle"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("busy_imbalance", "busy-time imbalance (max / mean)"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for policy in policies:
            by_label = {s.label or "-": getattr(s, key) for s in summaries if s.policy == policy}
            values = [by_label.get(label, float("nan")) for label in labels]
            if len(labels) == 1:
                ax.bar(policy, values[0])
            else:
                ax.plot(range(len(labels)), values, marker="o", label=policy)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        if len(labels) > 1:  # "workers=8": the name once, under the axis; the values as ticks
            ax.set_xticks(range(len(labels)), [label.partition("=")[2] for label in labels])
            ax.set_xlabel(labels[0].partition("=")[0], fontsize=9)
    if len(labels) > 1:
        axes[0].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
