"""`cachesvc simulate`: replay a Mooncake trace at full size (or the hot-prefix workload) through
the router's own policies, prefix index and block pools, without a model; time comes from a
cost profile.

Pieces, one file each in this package: `trace` (the requests and the oracle), `generate` (a
generated trace), `cost_profile` (the clock), `tier`, `seq`, `loads` and `worker` (one worker's
tiers, requests, loads and scheduler), `loop` (the event loop and the router), `report` (what
is printed); with prefill/decode roles, `pd` (where a request goes), `goodput` (against an SLO),
`pd_sweep` (and its plot). A profile measured here is `cachesvc.bench.calibrate`'s (it runs the
real engine: a live measurement). This module runs policies (each with or without pulls between
workers: "least_loaded+pull") over one cluster, or a sweep of clusters.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachesvc.sim.cost_profile import CostProfile, TierReadCost, load_profile
from cachesvc.sim.generate import GeneratedTrace, generate_rows, write_trace
from cachesvc.sim.goodput import SLO
from cachesvc.sim.loop import ClusterSpec, replay
from cachesvc.sim.report import (
    SimSummary,
    format_summaries,
    oracle_ratio,
    plot_summaries,
    summarize,
    to_json,
)
from cachesvc.sim.trace import (
    HotPrefix,
    SimRequest,
    bench_routing_requests,
    hot_prefix_requests,
    load_trace,
    num_unique_blocks,
    replicate_users,
    trace_requests,
)
from cachesvc.workloads.routing import Variant, variants_for
from cachesvc.workloads.sessions import load_mooncake
from cachesvc.workloads.table import write_json

SWEEPABLE = ("workers", "device-blocks", "dram-blocks", "nvme-blocks")
WORKLOADS = ("trace", "hot-prefix", "generated")
PULL = "+pull"  # a policy's suffix: the same policy, with pulls between workers


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


# Device blocks per worker unless told: a small share of a trace's blocks makes the cache
# matter; the hot-prefix workload is about compute, so its cache always has room (64k tokens).
# A generated trace grows with the cluster, so a share of its blocks would too: a fixed number
# (a fifth of what 8 workers' default trace brings, as 5% of the sample's blocks is).
DEFAULT_DEVICE_BLOCKS = {
    "trace": Size(fraction=0.05),
    "hot-prefix": Size(blocks=4096),
    "generated": Size(blocks=1024),
}


@dataclass(frozen=True)
class SimulateArgs:
    trace: str | None = None
    workload: str = "trace"  # one of WORKLOADS
    hot_prefix: HotPrefix = HotPrefix()
    generated: GeneratedTrace = GeneratedTrace()
    write_trace_path: str | None = None  # save the generated trace (for --workers) here
    profile: str = "h100-llama3-8b"
    peer_gbps: float | None = None  # a pull's bandwidth, instead of the profile's
    workers: int = 8
    device_blocks: Size | None = None  # None: the workload's DEFAULT_DEVICE_BLOCKS
    dram_blocks: Size = Size(blocks=0)
    nvme_blocks: Size = Size(blocks=0)
    # "name" or "name+pull"; empty: every registered policy for a trace, affinity only, load
    # only and load-aware with pulls for hot-prefix (`routing.variants_for`).
    policies: tuple[str, ...] = ()
    peer_pull: bool = False  # run every policy with pulls as well
    policy_options: Mapping[str, Any] = field(default_factory=dict)  # for prefix_aware
    time_scale: float = 1.0
    # Give every cluster the load per worker this many workers get from a trace: arrivals
    # compressed by workers / scale_arrivals (None: as recorded, times `time_scale`).
    scale_arrivals: int | None = None
    # Or give it that load by replaying workers / scale_users copies of the trace's users, each
    # with hash ids of its own (`replicate_users`): more sessions per cluster, not faster ones.
    scale_users: int | None = None
    max_requests: int | None = None
    sweep: str | None = None  # "workers=2,4,8" or "device-blocks=5%,20%"
    json_path: str | None = None
    plot_path: str | None = None
    # Replay what `cachesvc bench routing --workload trace` sends instead of the full trace.
    like_bench_routing: bool = False
    # Or what `cachesvc bench pd` sends (`like_bench_pd`), at its `--quick` sizes with `quick`.
    like_bench_pd: bool = False
    quick: bool = False
    # Prefill/decode roles (`pd_sweep`): one mode ("colocated", "always", "decide") with
    # `prefill_workers` of the workers prefilling, or the sweep over modes, ratios and loads.
    pd: str | None = None
    prefill_workers: int = 1
    pd_sweep: bool = False
    slo: SLO = SLO()
    loads: tuple[float, ...] = (0.5, 0.8, 1.0, 1.2)  # fractions of the estimated capacity
    stall_weight: float | None = None  # decide's; None: the SLO's (`SLO.stall_weight`)
    pd_decide_slo: bool = False  # decide against the router's latency targets, set to `slo`'s
    # Decode workers pull while the prefill runs (the router's `pd_prefetch`); off: from the
    # first token on.
    pd_prefetch: bool = True
    # The router's admission targets (`admit_ttft_ms`, `admit_itl_ms`), in every P/D mode
    # (None: admit all).
    admit_ttft_ms: float | None = None
    admit_itl_ms: float | None = None


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


def parse_variant(text: str) -> Variant:
    """A policy as `--policy` names it ("least_loaded", "least_loaded+pull"); a ValueError
    lists the policies."""
    from router.policy.routing import policy_names

    name = text.removesuffix(PULL)
    if name not in policy_names():
        raise ValueError(
            f"--policy takes a policy, optionally with {PULL!r}: one of {policy_names()}, "
            f"got {text!r}"
        )
    return Variant(text, name, text.endswith(PULL))


def variants(args: SimulateArgs) -> list[Variant]:
    """The policies `args` asks for, each with pulls or not, each once."""
    if args.policies:
        chosen = [parse_variant(text) for text in args.policies]
    else:
        chosen = variants_for(args.workload)
    if args.peer_pull:
        chosen = [w for v in chosen for w in (v, Variant(v.policy + PULL, v.policy, True))]
    return list(dict.fromkeys(chosen))


def served_alone_s(profile: CostProfile, prompt_len: int, output_len: int) -> float:
    """Seconds one request takes on an idle worker of `profile`: its prompt in chunks of the
    step budget, then one step per further output token."""
    total, done = 0.0, 0
    while done < prompt_len:
        k = min(profile.max_num_batched_tokens, prompt_len - done)
        total += profile.step_s([(k, done)], [])
        done += k
    for i in range(1, output_len):
        total += profile.step_s([], [prompt_len + i])
    return total


def profile_for(args: SimulateArgs) -> CostProfile:
    """The cost profile of `args`, with its pull bandwidth replaced if asked."""
    profile = load_profile(args.profile)
    if args.peer_gbps is None:
        return profile
    if args.peer_gbps <= 0:
        raise ValueError(f"--peer-gbps must be positive, got {args.peer_gbps}")
    peer = TierReadCost(profile.peer.latency_s, 1 / (args.peer_gbps * 1e9))
    return dataclasses.replace(profile, peer=peer)


def spec_for(args: SimulateArgs, unique_blocks: int, block_size: int) -> ClusterSpec:
    device = args.device_blocks
    if device is None:
        device = DEFAULT_DEVICE_BLOCKS[args.workload]
    return ClusterSpec(
        num_workers=args.workers,
        device_blocks=device.resolve(unique_blocks),
        dram_blocks=args.dram_blocks.resolve(unique_blocks),
        nvme_blocks=args.nvme_blocks.resolve(unique_blocks),
        block_size=block_size,
    )


def load_requests(args: SimulateArgs) -> list[SimRequest]:
    """The requests one cluster of `args` replays (with `scale_arrivals`, or a generated
    trace, they depend on its number of workers)."""
    if args.workload not in WORKLOADS:
        raise ValueError(f"--workload must be one of {WORKLOADS}, got {args.workload!r}")
    if args.workload == "hot-prefix":
        # The forks come `fork_at_s` after the parent is served (alone, as the profile predicts
        # it), as the live bench times them: the context is held somewhere when they arrive.
        shape = args.hot_prefix
        parent_s = served_alone_s(
            profile_for(args), shape.prefix_len + shape.suffix_len, shape.output_len
        )
        return hot_prefix_requests(dataclasses.replace(shape, fork_at_s=shape.fork_at_s + parent_s))
    if args.workload == "generated":
        rows = generate_rows(args.generated, args.workers)[: args.max_requests]
        return trace_requests(rows, args.time_scale)
    if args.trace is None:
        raise ValueError("a trace workload needs --trace FILE (a Mooncake JSONL trace)")
    time_scale = args.time_scale
    if args.scale_users is not None:
        return _replicated_requests(args)
    if args.scale_arrivals is not None:
        if args.scale_arrivals < 1:
            raise ValueError(
                f"--scale-arrivals must be a number of workers, not {args.scale_arrivals}"
            )
        time_scale *= args.scale_arrivals / args.workers
    if args.like_bench_routing:
        requests = bench_routing_requests(args.trace, args.max_requests)
        return [dataclasses.replace(r, arrival_s=r.arrival_s * time_scale) for r in requests]
    return load_trace(args.trace, time_scale, args.max_requests)


def user_copies(args: SimulateArgs) -> int:
    """How many copies of the trace's users a cluster of `args` replays (1 without
    `scale_users`)."""
    if args.scale_users is None or args.workload != "trace":
        return 1
    return max(1, round(args.workers / max(1, args.scale_users)))


def _replicated_requests(args: SimulateArgs) -> list[SimRequest]:
    """The trace's users copied to give the cluster the load per worker `scale_users` workers
    get from it: workers / scale_users copies, rounded; what rounding leaves (32 workers at
    --scale-users 12: 3 copies for 2.67) is made up by scaling the arrivals."""
    per = args.scale_users
    if per is None or per < 1:
        raise ValueError(f"--scale-users must be a number of workers, not {per}")
    if args.scale_arrivals is not None or args.like_bench_routing:
        raise ValueError("--scale-users replaces --scale-arrivals and --like-bench-routing")
    assert args.trace is not None
    copies = user_copies(args)
    rows = replicate_users(load_mooncake(args.trace)[: args.max_requests], copies)
    return trace_requests(rows, args.time_scale * copies * per / args.workers)


def cluster_spec(args: SimulateArgs, requests: Sequence[SimRequest]) -> ClusterSpec:
    """The cluster of `args` for its `requests`. A share of the trace's blocks is a share of one
    copy's (`user_copies`): copies of the users bring more workers of the same size."""
    unique = num_unique_blocks(requests) // user_copies(args)
    return spec_for(args, unique, requests[0].block_size)


def simulate(args: SimulateArgs) -> list[SimSummary]:
    """Every policy of `args` on every cluster of `args`, each over its requests."""
    profile = profile_for(args)
    summaries = []
    for label, run_args in clusters(args):
        requests = load_requests(run_args)
        oracle = oracle_ratio(requests)
        spec = cluster_spec(run_args, requests)
        _describe(run_args, label, requests, spec, num_unique_blocks(requests))
        for v in variants(args):
            options = args.policy_options if v.policy == "prefix_aware" else {}
            run = replay(requests, profile, spec, v.policy, options, v.peer_pull)
            summaries.append(summarize(run, requests, label, oracle))
            print(f"  {label or 'run'} {v.label}: {run.wall_s:.1f} s", file=sys.stderr, flush=True)
    return summaries


def _describe(
    args: SimulateArgs, label: str, requests: Sequence[SimRequest], spec: ClusterSpec, unique: int
) -> None:
    """One line on stderr: what a cluster replays."""
    peer = profile_for(args).peer
    pulls = any(v.peer_pull for v in variants(args))
    print(
        f"{label + ': ' if label else ''}{args.workload}: {len(requests)} requests over "
        f"{requests[-1].arrival_s:.1f} s, {unique} unique blocks of {spec.block_size} tokens; "
        f"{spec.num_workers} workers x {spec.device_blocks} device blocks "
        f"(dram {spec.dram_blocks}, nvme {spec.nvme_blocks}); profile {args.profile}"
        + (
            f"; pulls {peer.latency_s * 1e3:g} ms + {peer.bytes_per_s / 1e9:g} GB/s"
            if pulls
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )


def run_simulate(args: SimulateArgs) -> int:
    """Blocking entry point of `cachesvc simulate`; prints the table, returns 0."""
    if args.write_trace_path is not None:
        if args.workload != "generated":
            raise ValueError("--write-trace saves a generated trace: use --workload generated")
        write_trace(generate_rows(args.generated, args.workers), args.write_trace_path)
    summaries = simulate(args)
    print(format_summaries(summaries))
    write_json(args.json_path, [to_json(s) for s in summaries])
    if args.plot_path:
        plot_summaries(summaries, args.plot_path)
    return 0
