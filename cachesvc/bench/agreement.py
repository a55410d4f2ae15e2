"""`cachesvc bench sim-agreement`: the simulator against live runs of the same workloads.

Live, `runs` times each (real SmolLM2 workers on this machine behind a real router, as the
benches run them): `cachesvc bench routing --workload trace --trace T` (every policy; the
`--quick` sample with `quick`) and `cachesvc bench pd` (its `--quick` sizes with `quick`).
Simulated, once (the simulator is deterministic): the same requests, `cachesvc simulate
--like-bench-routing` on two workers of 128 blocks and `cachesvc simulate --like-bench-pd`,
with a cost profile (`cpu-calibrated` unless told; with `calibrate`, one measured first, in the
same sitting as the live runs, by `cachesvc simulate calibrate`). Then every figure both report,
with its error (`agreement_report`). Each live run records the machine's load average: other
work on a shared machine moves live latencies by more than the simulator's error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.bench.agreement_report import Figure, format_figures, pd_figures, routing_figures
from cachesvc.bench.calibrate.run import calibrate_profile, measure_slowdown, speed_ratio
from cachesvc.bench.pd import measure_pd
from cachesvc.bench.routing import run_all_policies
from cachesvc.sim.cost_profile import CostProfile, load_profile, save_profile
from cachesvc.sim.like_bench_pd import replay_bench_pd
from cachesvc.sim.loop import replay
from cachesvc.sim.report import SimSummary, summarize
from cachesvc.sim.simulate import SimulateArgs, Size, cluster_spec, load_requests, variants
from cachesvc.workloads.pd import PDBenchArgs, PDShape, PhaseResult
from cachesvc.workloads.routing import RoutingBenchArgs, build_workload, variants_for
from cachesvc.workloads.routing_report import PolicyResult, to_json
from cachesvc.workloads.table import write_json

BENCHES = ("routing", "pd")
ROUTING_WORKERS = 2
ROUTING_BLOCKS = 128  # `cachesvc bench routing`'s default per worker
QUICK_REQUESTS = 24  # its --quick sample


@dataclass(frozen=True)
class AgreementArgs:
    trace: str | None = None  # the Mooncake trace `bench routing` samples (needed for routing)
    quick: bool = False
    runs: int = 3
    profile: str = "cpu-calibrated"
    calibrate: bool = False  # measure a profile first, into `profile_out` (or a temporary file)
    profile_out: str | None = None
    benches: tuple[str, ...] = BENCHES
    model: str | None = None
    json_path: str | None = None
    itl_slo_ms: float | None = None  # bench pd's --itl-slo-ms, live and simulated
    # The live runs an earlier `--json` recorded, compared again instead of running new ones
    # (a model or profile change judged against the same measurements).
    live_from: str | None = None

    def __post_init__(self) -> None:
        if self.live_from is not None and self.calibrate:
            raise ValueError("--live-from compares recorded runs: measure no profile with it")
        if self.runs < 1:
            raise ValueError(f"--runs must be at least 1, got {self.runs}")
        unknown = set(self.benches) - set(BENCHES)
        if unknown or not self.benches:
            raise ValueError(f"--only takes {' or '.join(BENCHES)}, got {sorted(unknown)}")
        if "routing" in self.benches and self.trace is None:
            raise ValueError("the routing bench needs --trace FILE (a Mooncake JSONL trace)")


@dataclass
class LiveRun:
    """One live run of each bench, with the machine's 1-minute load average around it and how
    much slower than the profile it stepped the engine (`calibrate.measure_slowdown`, the mean
    of before and after)."""

    routing: list[PolicyResult]
    pd: list[PhaseResult]
    load_before: float
    load_after: float
    slowdown: float


def live_routing(args: AgreementArgs) -> list[PolicyResult]:
    """One run of `cachesvc bench routing --workload trace` (blocking): every policy."""
    import ray

    from workers.cluster import WorkerGroup, spawn_workers, stop_workers
    from workers.config import EngineConfig

    bench = RoutingBenchArgs(workers=ROUTING_WORKERS, workload="trace", trace=args.trace)
    bench = dataclasses.replace(bench, quick=args.quick, model=args.model)
    engine = EngineConfig.from_env(
        model=args.model, block_size=16, num_blocks=ROUTING_BLOCKS, num_threads=1
    )
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    actors: dict[Any, Any] = {}
    try:
        namespace = f"agreement-{uuid.uuid4().hex[:6]}"
        actors = spawn_workers(WorkerGroup(engine, ROUTING_WORKERS, namespace, device="cpu"))
        vocab = ray.get(next(iter(actors.values())).info.remote()).vocab_size
        sessions = build_workload(bench, "trace", vocab)
        variants = variants_for("trace")
        return asyncio.run(run_all_policies(actors, args.model, sessions, "trace", variants))
    finally:
        stop_workers(actors)
        ray.shutdown()


def live_runs(args: AgreementArgs, profile: CostProfile) -> list[LiveRun]:
    runs = []
    for i in range(args.runs):
        before = os.getloadavg()[0]
        slow_before = measure_slowdown(profile, args.model)
        _say(f"live run {i + 1} of {args.runs}: load {before:.1f}, slowdown {slow_before:.2f}")
        routing = live_routing(args) if "routing" in args.benches else []
        bench_pd = PDBenchArgs(args.quick, args.model, itl_slo_ms=args.itl_slo_ms)
        pd = measure_pd(bench_pd) if "pd" in args.benches else []
        after = os.getloadavg()[0]
        slowdown = (slow_before + measure_slowdown(profile, args.model)) / 2
        runs.append(LiveRun(routing, pd, before, after, slowdown))
    return runs


def load_runs(path: str, benches: Sequence[str], profile: CostProfile) -> list[LiveRun]:
    """The live runs an earlier `cachesvc bench sim-agreement --json` wrote to `path`, their
    slowdowns against `profile` (they were measured against the file's); a bench in `benches`
    that they lack is a ValueError."""
    data = json.loads(Path(path).read_text())
    rebase = speed_ratio(CostProfile.from_json(data["profile"]), profile)
    runs = [
        LiveRun(
            [PolicyResult(**r) for r in run["routing"]],
            [PhaseResult(**r) for r in run["pd"]],
            run["load_average"][0],
            run["load_average"][1],
            run["slowdown"] * rebase,
        )
        for run in data["runs"]
    ]
    for bench in benches:
        if not all(getattr(r, bench) for r in runs):
            raise ValueError(f"{path} has no live {bench} runs: pass --only for the others")
    return runs


def simulated_routing(args: AgreementArgs, profile: CostProfile) -> list[SimSummary]:
    """`cachesvc simulate --like-bench-routing` for the live bench's sample: every policy, with
    the router's default thresholds."""
    from router.config import RouterConfig

    sim = SimulateArgs(
        trace=args.trace,
        workers=ROUTING_WORKERS,
        device_blocks=Size(blocks=ROUTING_BLOCKS),
        like_bench_routing=True,
        max_requests=QUICK_REQUESTS if args.quick else None,
    )
    requests = load_requests(sim)
    spec = cluster_spec(sim, requests)
    options = RouterConfig().policy_options()
    summaries = []
    for v in variants(sim):
        run = replay(
            requests, profile, spec, v.policy, options if v.policy == "prefix_aware" else {}
        )
        summaries.append(summarize(run, requests))
    return summaries


def simulated_figures(
    args: AgreementArgs, runs: Sequence[LiveRun], profile: CostProfile
) -> list[Figure]:
    """Every figure of `runs` beside the simulator's with `profile`."""
    figures: list[Figure] = []
    if "routing" in args.benches:
        figures += routing_figures([r.routing for r in runs], simulated_routing(args, profile))
    if "pd" in args.benches:
        simulated = replay_bench_pd(profile, PDShape(args.quick), itl_slo_ms=args.itl_slo_ms)
        figures += pd_figures([r.pd for r in runs], simulated)
    return figures


def compare(args: AgreementArgs, runs: Sequence[LiveRun], profile: CostProfile) -> list[Figure]:
    """Every figure, simulated with `profile` as it is and with each run's slowdown."""
    figures = simulated_figures(args, runs, profile)
    slowed = [simulated_figures(args, runs, profile.slowed(r.slowdown)) for r in runs]
    return [
        dataclasses.replace(f, at_speed=tuple(s[i].simulated for s in slowed))
        for i, f in enumerate(figures)
    ]


def run_agreement(args: AgreementArgs) -> int:
    """Blocking entry point of `cachesvc bench sim-agreement`; prints the table, returns 0."""
    with tempfile.TemporaryDirectory(prefix="cachesvc-agreement-") as tmp:
        profile = args.profile
        if args.calibrate:
            measured = calibrate_profile(args.model, 1, load_profile(args.profile))
            profile = args.profile_out or str(Path(tmp) / "measured.json")
            save_profile(measured, profile)
            _say(f"profile measured now: {profile}")
        used = load_profile(profile)
    if args.live_from:
        runs = load_runs(args.live_from, args.benches, used)
    else:
        runs = live_runs(args, used)
    figures = compare(args, runs, used)
    print(format_figures(figures))
    loads = ", ".join(
        f"{r.load_before:.1f}-{r.load_after:.1f} (slowdown {r.slowdown:.2f})" for r in runs
    )
    print(
        f"profile {'measured now' if args.calibrate else args.profile}; each live run's load "
        f"average before-after on {os.cpu_count()} cores: {loads}"
    )
    write_json(
        args.json_path,
        {
            "profile": used.to_json(),
            "figures": [{**dataclasses.asdict(f), "error": f.error} for f in figures],
            "runs": runs_to_json(runs),
        },
    )
    return 0


def runs_to_json(runs: Sequence[LiveRun]) -> list[dict[str, Any]]:
    return [
        {
            "routing": [to_json(r) for r in run.routing],
            "pd": [dataclasses.asdict(r) for r in run.pd],
            "load_average": [run.load_before, run.load_after],
            "slowdown": run.slowdown,
        }
        for run in runs
    ]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
