"""`cachesvc simulate`: replay a Mooncake trace at full size through the router's own policies,
prefix index and block pools, without a model; time comes from a cost profile.

Pieces, one file each: `simulate_trace` (the trace and the oracle), `simulate_profile` (the
clock), `simulate_tier` and `simulate_worker` (one worker's tiers and scheduler), `simulate_loop`
(the event loop and the router), `simulate_report` (what is printed), `simulate_calibrate` (a
profile measured here). This module runs policies over one cluster, or a sweep of clusters.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.bench.simulate_loop import ClusterSpec, replay
from cachesvc.bench.simulate_profile import load_profile
from cachesvc.bench.simulate_report import (
    SimSummary,
    format_summaries,
    oracle_ratio,
    plot_summaries,
    summarize,
    to_json,
)
from cachesvc.bench.simulate_trace import (
    SimRequest,
    bench_routing_requests,
    load_trace,
    num_unique_blocks,
)
from cachesvc.bench.table import write_json

SWEEPABLE = ("workers", "device-blocks", "dram-blocks", "nvme-blocks")


@dataclass(frozen=True)
class Size:
    """A capacity in blocks, or as a fraction of the trace's unique blocks ("5%")."""

    blocks: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> Size:
        text = text.strip()
        try:
            if text.endswith("%"):
                fraction = float(text[:-1]) / 100
                if fraction < 0:
                    raise ValueError
                return cls(fraction=fraction)
            blocks = int(text)
            if blocks < 0:
                raise ValueError
            return cls(blocks=blocks)
        except ValueError:
            raise ValueError(
                f"a size is a number of blocks or a percentage, got {text!r}"
            ) from None

    def resolve(self, unique_blocks: int) -> int:
        if self.blocks is not None:
            return self.blocks
        return round((self.fraction or 0.0) * unique_blocks)

    def __str__(self) -> str:
        return f"{self.blocks}" if self.blocks is not None else f"{(self.fraction or 0) * 100:g}%"


@dataclass(frozen=True)
class SimulateArgs:
    trace: str
    profile: str = "h100-llama3-8b"
    workers: int = 8
    device_blocks: Size = Size(fraction=0.05)
    dram_blocks: Size = Size(blocks=0)
    nvme_blocks: Size = Size(blocks=0)
    policies: tuple[str, ...] = ()  # empty: every registered policy
    policy_options: Mapping[str, Any] = field(default_factory=dict)  # for prefix_aware
    time_scale: float = 1.0
    max_requests: int | None = None
    sweep: str | None = None  # "workers=2,4,8" or "device-blocks=5%,20%"
    json_path: str | None = None
    plot_path: str | None = None
    # Replay what `cachesvc bench routing --workload trace` sends instead of the full trace.
    like_bench_routing: bool = False


def parse_sweep(text: str) -> tuple[str, list[str]]:
    """("workers", ["2", "4"]) from "workers=2,4"; a ValueError says what is allowed."""
    name, _, values = text.partition("=")
    name = name.strip()
    if name not in SWEEPABLE or not values.strip():
        raise ValueError(f"--sweep takes NAME=V1,V2,... with NAME one of {SWEEPABLE}, got {text!r}")
    return name, [v.strip() for v in values.split(",") if v.strip()]


def clusters(args: SimulateArgs) -> list[tuple[str, SimulateArgs]]:
    """The runs `args` asks for: one, or one per value of the sweep, with its label."""
    if args.sweep is None:
        return [("", args)]
    name, values = parse_sweep(args.sweep)
    out = []
    for value in values:
        changes: dict[str, Any] = (
            {"workers": int(value)}
            if name == "workers"
            else {name.replace("-", "_"): Size.parse(value)}
        )
        changed = dataclasses.replace(args, **changes)
        out.append((f"{name}={value}", changed))
    return out


def spec_for(args: SimulateArgs, unique_blocks: int, block_size: int) -> ClusterSpec:
    return ClusterSpec(
        num_workers=args.workers,
        device_blocks=args.device_blocks.resolve(unique_blocks),
        dram_blocks=args.dram_blocks.resolve(unique_blocks),
        nvme_blocks=args.nvme_blocks.resolve(unique_blocks),
        block_size=block_size,
    )


def load_requests(args: SimulateArgs) -> list[SimRequest]:
    if args.like_bench_routing:
        requests = bench_routing_requests(args.trace, args.max_requests)
        return [dataclasses.replace(r, arrival_s=r.arrival_s * args.time_scale) for r in requests]
    return load_trace(args.trace, args.time_scale, args.max_requests)


def simulate(args: SimulateArgs, requests: Sequence[SimRequest]) -> list[SimSummary]:
    """Every policy of `args` on every cluster of `args`, over `requests`."""
    from router.policy import policy_names

    profile = load_profile(args.profile)
    unique = num_unique_blocks(requests)
    oracle = oracle_ratio(requests)
    policies = args.policies or tuple(policy_names())
    summaries = []
    for label, run_args in clusters(args):
        spec = spec_for(run_args, unique, requests[0].block_size)
        for policy in policies:
            options = args.policy_options if policy == "prefix_aware" else {}
            run = replay(requests, profile, spec, policy, options)
            summaries.append(summarize(run, requests, label, oracle))
            print(f"  {label or 'run'} {policy}: {run.wall_s:.1f} s", file=sys.stderr, flush=True)
    return summaries


def run_simulate(args: SimulateArgs) -> int:
    """Blocking entry point of `cachesvc simulate`; prints the table, returns 0."""
    requests = load_requests(args)
    unique = num_unique_blocks(requests)
    spec = spec_for(args, unique, requests[0].block_size)
    print(
        f"{len(requests)} requests over {requests[-1].arrival_s:.0f} s, {unique} unique blocks "
        f"of {spec.block_size} tokens; "
        f"{args.workers} workers x {spec.device_blocks} device blocks "
        f"(dram {spec.dram_blocks}, nvme {spec.nvme_blocks}); profile {args.profile}",
        file=sys.stderr,
    )
    summaries = simulate(args, requests)
    print(format_summaries(summaries))
    write_json(args.json_path, [to_json(s) for s in summaries])
    if args.plot_path:
        plot_summaries(summaries, args.plot_path)
    return 0
