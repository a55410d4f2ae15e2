"""What `cachesvc bench routing` runs, one definition for the live bench and for the simulator
(`cachesvc simulate`): the workloads by name, the rows of its table (`Variant`: a policy, with or
without pulls between workers), its arguments, and the sessions a workload sends."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cachesvc.workloads.sessions import (
    Session,
    TraceScale,
    groups_workload,
    hot_prefix_workload,
    load_mooncake,
    multiturn_workload,
    trace_workload,
)

WORKLOADS = ("groups", "multiturn", "trace", "hot-prefix")


@dataclass(frozen=True)
class Variant:
    """One row of the table: a routing policy, with or without pulls between workers."""

    label: str
    policy: str
    peer_pull: bool = False


# Affinity only, load only (recompute), and load-aware with pulls.
PULL_VARIANTS = (
    Variant("longest_prefix", "longest_prefix"),
    Variant("least_loaded", "least_loaded"),
    Variant("least_loaded+pull", "least_loaded", True),
    Variant("prefix_aware+pull", "prefix_aware", True),
)


def variants_for(workload: str) -> list[Variant]:
    """Every policy as it is for most workloads; affinity, load and pulls for hot-prefix."""
    from router.policy.routing import policy_names

    if workload == "hot-prefix":
        return list(PULL_VARIANTS)
    return [Variant(name, name) for name in policy_names()]


@dataclass(frozen=True)
class RoutingBenchArgs:
    workers: int = 2
    workload: str = "groups"
    trace: str | None = None
    json_path: str | None = None
    plot_path: str | None = None
    quick: bool = False
    model: str | None = None
    tiny: bool = False
    rate: float | None = None
    num_blocks: int | None = None  # None: 128, or 1024 with hot-prefix (long prompts at once)
    trace_scale: TraceScale = TraceScale()


def build_workload(args: RoutingBenchArgs, workload: str, vocab_size: int) -> list[Session]:
    """The sessions of `workload` at the sizes `args` asks for, arriving at a rate that fits
    the model (a tiny one, or SmolLM2 on two CPU cores)."""
    rate = args.rate if args.rate is not None else (20.0 if args.tiny else 1.5)
    if workload == "groups":
        size = {"num_groups": 6, "prompts_per_group": 4} if args.quick else {}
        out_len = 4 if args.quick else 8
        return groups_workload(vocab_size, system_len=128, output_len=out_len, rate=rate, **size)
    if workload == "multiturn":
        size = {"num_users": 6, "num_turns": 3} if args.quick else {"num_users": 8, "num_turns": 4}
        return multiturn_workload(vocab_size, output_len=4, rate=rate / 2, **size)
    if workload == "hot-prefix":
        burst = args.rate if args.rate is not None else 8.0
        small = args.tiny or args.quick
        # A context long enough that recomputing it costs more than a fork's own work, and
        # forks with enough work of their own that one worker can not serve them all at once.
        return hot_prefix_workload(
            vocab_size,
            prefix_len=256 if small else 2048,
            num_forks=8 if small else 12,
            suffix_len=32 if small else 128,
            output_len=4 if args.quick else 16,
            rate=burst,
        )
    assert workload == "trace" and args.trace is not None, "checked by run_routing_bench"
    scale = args.trace_scale
    if args.quick:
        scale = dataclasses.replace(scale, max_requests=min(scale.max_requests, 24))
    return trace_workload(load_mooncake(args.trace), vocab_size, scale)
