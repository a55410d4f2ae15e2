"""`cachesvc simulate --pd MODE` and `--pd-sweep`: goodput under an SLO with prefill/decode roles.

One run replays the workload in one mode (`cachesvc.sim.pd`). The sweep first estimates the
cluster's capacity (`estimate_capacity`: the highest arrival rate the colocated cluster keeps
up with), then at each load (a fraction of that rate, arrivals scaled to it) replays
colocated, always-disaggregated at every prefill:decode ratio, per-request decisions at every
ratio and per-request decisions over mixed workers (`dynamic`), and reports each mode at its
best ratio. The plot (`plot_rows`) draws each mode at its best ratio against the load.

Per-request decisions weigh the decode streams' loss against the request's own wait with
`router.policy.pd.decide`'s `stall_weight`; unless told, it is the SLO's (`SLO.stall_weight`): a
second lost by a stream, as a share of its ITL budget over the workload's mean answer, against
a second of the request's TTFT budget.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.goodput import SLO, Goodput, goodput
from cachesvc.sim.loop import ClusterSpec, PDSetup, SimRun, replay
from cachesvc.sim.pd import ALWAYS, COLOCATED, DECIDE, DYNAMIC, MIXED_MODES
from cachesvc.sim.simulate import SimulateArgs, cluster_spec, load_requests, profile_for
from cachesvc.sim.trace import SimRequest
from cachesvc.workloads.table import format_table, write_json
from router.policy.admission import Admission, admission_targets
from router.policy.pd import SLO as TargetsSLO

DEFAULT_LOADS = (0.5, 0.8, 1.0, 1.2)
KEEPS_UP = 0.95  # completed requests per second of the makespan, as a share of the offered
_BISECTIONS = 5


@dataclass(frozen=True)
class PDRow:
    """One replay: a mode and ratio at a load."""

    load: float  # fraction of the estimated capacity (0.0: the workload's own arrivals)
    rate_rps: float  # offered: requests / their arrival span
    mode: str
    num_workers: int
    num_prefill: int  # prefill workers (0 colocated); the rest decode
    stall_weight: float  # decide's (0.0 when it is not called)
    pulls: bool  # the router named holders to pull prefixes from
    result: Goodput
    decisions: Mapping[str, int]  # decide's reasons, without their numbers, counted
    wall_s: float


Replay = Callable[[Sequence[SimRequest], PDSetup, bool], SimRun]


def replayer(
    profile: CostProfile, spec: ClusterSpec, policy: str, options: Mapping[str, Any]
) -> Replay:
    """Replays a workload on one cluster with a given `PDSetup`, with pulls between workers
    (the router naming holders, as it does by default) or not."""

    def run(requests: Sequence[SimRequest], pd: PDSetup, peer_pull: bool) -> SimRun:
        return replay(requests, profile, spec, policy, options, peer_pull, pd)

    return run


def offered_rps(requests: Sequence[SimRequest]) -> float:
    span = requests[-1].arrival_s - requests[0].arrival_s
    return len(requests) / span if span > 0 else float("inf")


def at_rate(requests: Sequence[SimRequest], rate_rps: float) -> list[SimRequest]:
    """`requests` with their arrivals scaled so that they come at `rate_rps` on average."""
    factor = offered_rps(requests) / rate_rps
    return [dataclasses.replace(r, arrival_s=r.arrival_s * factor) for r in requests]


def keeps_up(run: SimRun, requests: Sequence[SimRequest]) -> bool:
    """Whether the cluster served `requests` about as fast as they came."""
    done = goodput(run, SLO())
    rate = done.num_requests / done.makespan_s if done.makespan_s > 0 else float("inf")
    return rate >= KEEPS_UP * offered_rps(requests)


def estimate_capacity(requests: Sequence[SimRequest], run: Replay) -> float:
    """The highest arrival rate (requests/s) at which the colocated cluster keeps up with the
    workload (`keeps_up`), to a few percent: doubling or halving from the workload's own rate,
    then bisecting (geometrically)."""
    colocated = PDSetup(COLOCATED)

    def ok(rate: float) -> bool:
        scaled = at_rate(requests, rate)
        return keeps_up(run(scaled, colocated, False), scaled)

    rate = offered_rps(requests)
    if ok(rate):
        lo, hi = rate, rate * 2
        while ok(hi):
            lo, hi = hi, hi * 2
    else:
        lo, hi = rate / 2, rate
        while not ok(lo):
            lo, hi = lo / 2, lo
    for _ in range(_BISECTIONS):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def one_run(
    requests: Sequence[SimRequest],
    run: Replay,
    pd: PDSetup,
    slo: SLO,
    load: float = 0.0,
    peer_pull: bool = True,
) -> PDRow:
    """Replay `requests` in one mode; its row."""
    result = run(requests, pd, peer_pull)
    reasons: dict[str, int] = {}
    if result.pd_routes is not None:
        for d in result.pd_routes.decisions.values():
            key = d.reason.partition(":")[0]  # "disaggregated" / "colocated"
            reasons[key] = reasons.get(key, 0) + 1
    weight = pd.stall_weight if pd.mode in (DECIDE, DYNAMIC) else 0.0
    return PDRow(
        load,
        offered_rps(requests),
        pd.mode,
        len(result.workers),
        pd.num_prefill,
        weight,
        peer_pull,
        goodput(result, slo),
        reasons,
        result.wall_s,
    )


def sweep(
    requests: Sequence[SimRequest],
    run: Replay,
    num_workers: int,
    slo: SLO,
    loads: Sequence[float] = DEFAULT_LOADS,
    stall_weight: float | None = None,
    targets: TargetsSLO | None = None,
    prefetch: bool = True,
    admit: Admission | None = None,
) -> tuple[float, list[PDRow]]:
    """(capacity, every replay's row): at each load, colocated, always-disaggregated and
    per-request decisions at every prefill:decode ratio, each without and with the router
    naming holders to pull prefixes from (a hand-off pulls either way); with `targets`, decide
    against the router's latency targets too; with `admit`'s targets, every mode refuses what
    admission refuses (the capacity is the colocated cluster's without it)."""
    weight = stall_weight if stall_weight is not None else slo.stall_weight(mean_output(requests))
    admit = admit or Admission()
    capacity = estimate_capacity(requests, run)
    _say(f"capacity: {capacity:.2f} requests/s colocated; decide's stall weight {weight:.3f}")
    rows = []
    for load in loads:
        scaled = at_rate(requests, load * capacity)
        colocated = PDSetup(COLOCATED, admit=admit)
        setups = [(colocated, pulls) for pulls in (False, True)] + [
            (PDSetup(mode, n, weight, targets, prefetch, admit=admit), pulls)
            for mode in (ALWAYS, DECIDE)
            for n in range(1, num_workers)
            for pulls in (False, True)
        ]
        dynamic = PDSetup(DYNAMIC, 0, weight, targets, prefetch, admit=admit)
        setups += [(dynamic, pulls) for pulls in (False, True)]
        for pd, pulls in setups:
            row = one_run(scaled, run, pd, slo, load, pulls)
            rows.append(row)
            _say(f"  load {load:g} {_label(row)}: goodput {row.result.goodput_rps:.2f}/s")
    return capacity, rows


def mean_output(requests: Sequence[SimRequest]) -> float:
    return statistics.fmean(r.output_len for r in requests)


def best_rows(rows: Sequence[PDRow]) -> list[PDRow]:
    """Per load and mode, the row of the ratio with the highest goodput (ties: fewer prefill
    workers)."""
    best: dict[tuple[float, str], PDRow] = {}
    for row in rows:
        key = (row.load, row.mode)
        held = best.get(key)
        if held is None or row.result.goodput_rps > held.result.goodput_rps:
            best[key] = row
    return list(best.values())


def format_rows(rows: Sequence[PDRow], slo: SLO) -> str:
    """The table of `rows`, then the SLO it was measured against."""
    headers = ["load", "req/s", "mode", "P:D", "pulls", "goodput/s", "met", "TTFT met"]
    headers += ["ITL met"]
    headers += ["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "disagg", "refused"]
    body = [
        [
            f"{r.load:g}" if r.load else "-",
            r.rate_rps,
            r.mode,
            _ratio(r),
            "yes" if r.pulls else "no",
            r.result.goodput_rps,
            r.result.attainment,
            r.result.ttft_met,
            r.result.itl_met,
            r.result.ttft_p50_ms,
            r.result.ttft_p99_ms,
            r.result.itl_p50_ms,
            r.result.itl_p99_ms,
            r.result.num_disaggregated / max(1, r.result.num_requests),
            r.result.num_refused / max(1, r.result.num_requests),
        ]
        for r in rows
    ]
    return "\n".join(
        [
            format_table(headers, body),
            "",
            f"SLO: TTFT <= {slo.ttft_ms:g} ms and mean inter-token latency <= {slo.itl_ms:g} ms, "
            "per request; goodput: requests within both per second of the makespan (a refused "
            "request meets neither)",
        ]
    )


def to_json(capacity: float | None, rows: Sequence[PDRow], slo: SLO) -> dict[str, Any]:
    """Every row, each marked whether it is its mode's best ratio at its load."""
    best = {id(r) for r in best_rows(rows)}
    return {
        "capacity_rps": capacity,
        "slo": dataclasses.asdict(slo),
        "runs": [{**dataclasses.asdict(r), "best": id(r) in best} for r in rows],
    }


def report(
    capacity: float | None,
    rows: Sequence[PDRow],
    slo: SLO,
    json_path: str | None = None,
    plot_path: str | None = None,
) -> str:
    """The table (each mode at its best ratio, for a sweep), written to JSON and a plot when
    asked."""
    shown = best_rows(rows) if capacity is not None else list(rows)
    write_json(json_path, to_json(capacity, rows, slo))
    if plot_path:
        plot_rows(best_rows(rows), plot_path)
    head = "" if capacity is None else f"capacity (colocated keeps up): {capacity:.2f} req/s\n"
    return head + format_rows(shown, slo)


def run_pd(args: SimulateArgs) -> int:
    """Blocking entry point of `cachesvc simulate --pd MODE | --pd-sweep`: prints the table,
    returns 0."""
    policies = args.policies or ("prefix_aware",)
    if len(policies) > 1 or "+" in policies[0]:
        raise ValueError("--pd and --pd-sweep route with one --policy (pulls: --peer-pull)")
    requests = load_requests(args)
    spec = cluster_spec(args, requests)
    options = args.policy_options if policies[0] == "prefix_aware" else {}
    run = replayer(profile_for(args), spec, policies[0], options)
    _say(
        f"{args.workload}: {len(requests)} requests at {offered_rps(requests):.2f}/s, mean "
        f"prompt {statistics.fmean(r.prompt_len for r in requests):.0f} tokens, mean answer "
        f"{mean_output(requests):.0f}; {spec.num_workers} workers x {spec.device_blocks} "
        f"device blocks; profile {args.profile}"
    )
    targets = router_targets(args.slo) if args.pd_decide_slo else None
    admit = admission_targets(args.admit_ttft_ms, args.admit_itl_ms)
    capacity: float | None = None
    if args.pd_sweep:
        capacity, rows = sweep(
            requests,
            run,
            spec.num_workers,
            args.slo,
            args.loads,
            args.stall_weight,
            targets,
            args.pd_prefetch,
            admit,
        )
    else:
        mode = args.pd or COLOCATED
        weight = args.stall_weight
        if weight is None:
            weight = args.slo.stall_weight(mean_output(requests))
        # Roles need pulls; colocated serving has them with --peer-pull.
        pulls = args.peer_pull or mode != COLOCATED
        num_prefill = 0 if mode in MIXED_MODES else args.prefill_workers
        pd = PDSetup(mode, num_prefill, weight, targets, args.pd_prefetch, None, admit)
        rows = [one_run(requests, run, pd, args.slo, peer_pull=pulls)]
    print(report(capacity, rows, args.slo, args.json_path, args.plot_path))
    return 0


def router_targets(slo: SLO) -> TargetsSLO:
    """The router's latency targets for `decide` (`pd_ttft_slo_ms`, `pd_itl_slo_ms`) set to
    `slo`'s, as an operator serving to that SLO would set them."""
    return TargetsSLO(slo.ttft_ms / 1e3, slo.itl_ms / 1e3)


def _ratio(row: PDRow) -> str:
    if row.mode in MIXED_MODES:
        return "-"
    return f"{row.num_prefill}:{row.num_workers - row.num_prefill}"


def _label(row: PDRow) -> str:
    pulls = "+pull" if row.pulls else ""
    return (row.mode if row.mode in MIXED_MODES else f"{row.mode} {row.num_prefill}P") + pulls


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---- the plot: per mode, goodput, TTFT p99 and inter-token latency p99 against the load ----

_PANELS = (
    ("goodput_rps", "goodput (requests/s within the SLO)"),
    ("ttft_p99_ms", "TTFT p99 (ms)"),
    ("itl_p99_ms", "inter-token latency p99 (ms)"),
)


def plot_rows(rows: Sequence[PDRow], path: str) -> None:
    """One line per mode over the loads of `rows` (a row per load and mode), into a PNG."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in rows))
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.4 * len(_PANELS), 3.4))
    for ax, (key, title) in zip(axes, _PANELS, strict=True):
        for mode in modes:
            mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.load)
            ax.plot(
                [r.load for r in mine],
                [getattr(r.result, key) for r in mine],
                marker="o",
                # Dynamic often lies on colocated (it keeps every request there): dashed, both show.
                linestyle="--" if mode == "dynamic" else "-",
                label=mode,
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("load (fraction of the colocated capacity)", fontsize=9)
        if key != "goodput_rps":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
