"""`cachesvc simulate eviction`: hit ratios of the eviction policies against LRU and Belady's
optimum, per workload and pool size (`cachesvc.sim.eviction`)."""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from cachesvc.app.cli.common import CliError, numbers


def add_eviction_parser(actions: Any) -> None:
    """Register `simulate eviction` on `simulate`'s actions."""
    from cachesvc.kv.eviction.base import POLICY_NAMES
    from cachesvc.sim.eviction import WORKLOADS

    ev = actions.add_parser(
        "eviction",
        help="hit ratio of each eviction policy vs LRU and Belady, per workload and pool size",
        description="Replay prefix lookups through one block store per policy at pool sizes "
        "given in percent of each workload's distinct blocks; Belady's offline optimum is the "
        "limit. Prints a table of hit ratios (percent of the blocks a hit could cover).",
    )
    ev.add_argument("--trace", help="a Mooncake JSONL trace, for the trace workload")
    ev.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help="of trace, multi-turn (conversations with shared system prompts), mixed "
        "(conversations and agents) (default: %(default)s; trace needs --trace)",
    )
    ev.add_argument("--sizes", default="1,2,5", help="pool sizes, %% of distinct blocks")
    ev.add_argument(
        "--policies", default=",".join(POLICY_NAMES), help="policies (default: %(default)s)"
    )
    ev.add_argument("--max-requests", type=int, default=None, help="replay the first N only")
    ev.add_argument("--json", dest="json_path", help="also write the raw results to this file")


def run_eviction_command(args: argparse.Namespace) -> int:
    from cachesvc.kv.eviction.base import POLICY_NAMES
    from cachesvc.sim.eviction import run_eviction, workload_requests
    from cachesvc.sim.eviction_report import bounds, choose_default, format_report, verdicts
    from cachesvc.workloads.table import write_json

    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICY_NAMES]
    if unknown or not policies:
        raise CliError(f"--policies takes some of {', '.join(POLICY_NAMES)}, got {args.policies}")
    sizes = numbers(args.sizes, "--sizes", float)
    if not sizes or min(sizes) <= 0 or max(sizes) > 100:
        raise CliError(f"--sizes takes percentages in (0, 100], got {args.sizes}")
    names = [w for w in args.workloads.split(",") if w]
    try:
        workloads = {w: workload_requests(w, args.trace, args.max_requests) for w in names}
    except (ValueError, OSError) as exc:
        raise CliError(f"--workloads: {exc}") from None
    results = run_eviction(workloads, sizes, policies)
    print(format_report(results))
    write_json(
        args.json_path,
        {
            "date": datetime.date.today().isoformat(),
            "trace": None if args.trace is None else Path(args.trace).name,
            "sizes_pct": list(sizes),
            "requests": {w: len(r) for w, r in workloads.items()},
            "default": choose_default(results),
            "verdicts": [v.as_dict() for v in verdicts(results)],
            "bounds": [v.as_dict() for v in bounds(results)],
            "results": [r.as_dict() for r in results],
        },
    )
    return 0
