"""The tables `cachesvc bench step` prints from its report (the same dict its JSON holds)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cachesvc.bench.step.phases import HOST_PHASES, PHASES
from cachesvc.workloads.table import format_table


def step_table(report: Mapping[str, Any]) -> str:
    """Per cell: the floor, each path's median step, their ratio, and in place over the floor."""
    rows = [
        [
            c["batch"],
            c["context"],
            f"{c['floor_ms']:.1f}",
            f"{c['paths']['in_place']['step_ms']:.1f}",
            f"{c['paths']['gather']['step_ms']:.1f}",
            c["in_place_over_gather"],
            c["in_place_over_gather_by_round"],
            c["paths"]["in_place"]["floor_ratio"],
        ]
        for c in report["cells"]
    ]
    headers = [
        "batch", "context", "floor ms", "in place ms", "gather ms", "ratio", "by round", "/ floor"
    ]  # fmt: skip
    return format_table(headers, rows)


def phase_table(report: Mapping[str, Any]) -> str:
    """Per cell and path: the mean ms of each phase, the rest, and the mean step."""
    rows = []
    for c in report["cells"]:
        for path, summary in c["paths"].items():
            phases = summary["phases_ms"]
            rows.append(
                [
                    c["batch"],
                    c["context"],
                    path,
                    *(f"{phases[p]:.2f}" for p in PHASES),
                    f"{summary['other_ms']:.2f}",
                    f"{summary['step_ms_mean']:.2f}",
                ]
            )
    return format_table(["batch", "context", "path", *PHASES, "other", "step"], rows)


def host_table(report: Mapping[str, Any]) -> str:
    """Per cell (in place): the host's mean ms a step by phase, its total (mean, median), its
    median in CPU time (this thread's: what a shared machine's waits leave out), and the goal
    of 1 ms + 20 us a sequence."""
    rows = []
    for c in report["cells"]:
        s = c["paths"]["in_place"]
        phases = {**s["phases_ms"], "other": s["other_ms"], "stream": s["stream_ms"]}
        rows.append(
            [
                c["batch"],
                c["context"],
                *(f"{phases[p]:.2f}" for p in HOST_PHASES),
                f"{s['host_ms']:.2f}",
                f"{s['host_ms_median']:.2f}",
                f"{s['host_cpu_ms_median']:.2f}",
                f"{host_goal_ms(c['batch']):.2f}",
            ]
        )
    headers = [
        "batch", "context", *HOST_PHASES, "host ms", "host median", "host cpu median", "goal ms"
    ]  # fmt: skip
    return format_table(headers, rows)


def host_goal_ms(batch: int) -> float:
    """The host's budget a decode step: 1 ms plus 20 us a sequence."""
    return 1.0 + 0.02 * batch


def print_report(report: Mapping[str, Any]) -> None:
    print(
        f"decode step: {report['model']} {report['dtype']}, {report['threads']} threads, "
        f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s; "
        f"{report['rounds']} rounds x {report['steps_per_round']} steps of each path, "
        "alternating; step = median ms"
    )
    if not report["kernel_built"]:
        print("the paged-decode kernel could not be built here: both paths gather")
    if report.get("shared_prefix"):
        print(
            f"every prompt of a cell starts with the same {report['shared_prefix']} tokens, "
            "counted once in the floor"
        )
    print(step_table(report))
    print("\nphases, mean ms a step:")
    print(phase_table(report))
    for name, what in PHASES.items():
        print(f"  {name}: {what}")
    print("\nhost work a step (in place), mean ms; stream: the worker's deltas, built and pickled:")
    print(host_table(report))
    for cell in report["skipped_cells"]:
        print(f"skipped batch {cell['batch']} context {cell['context']}: {cell['why']}")
