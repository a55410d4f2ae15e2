"""`cachesvc simulate`'s prefill/decode flags: the mode and roles, the SLO goodput counts,
the sweep's loads, and the router's admission targets; `pd_options` checks them and gives them
to `SimulateArgs`."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.app.cli.common import CliError, numbers


def add_pd_arguments(sim: Any) -> None:
    """Register the prefill/decode flags (roles, the SLO, the sweep, admission) on `sim`."""
    from cachesvc.sim.goodput import SLO
    from cachesvc.sim.pd import PD_MODES

    slo = SLO()
    pd = sim.add_argument_group("prefill/decode roles: goodput under an SLO")
    pd.add_argument(
        "--pd",
        choices=PD_MODES,
        default=None,
        help="colocated (all mixed), always (disaggregated), decide (per request, "
        "router.policy.pd.decide, with --prefill-workers) or dynamic (per request over mixed "
        "workers: the prompt where the policy chose or where it stalls fewer streams, the decode "
        "there or on another); prints goodput and latencies",
    )
    pd.add_argument(
        "--prefill-workers", type=int, default=1, help="of --workers, prefilling (the rest decode)"
    )
    pd.add_argument(
        "--pd-sweep",
        action="store_true",
        help="estimate the colocated capacity, then at each --loads replay colocated, "
        "always and decide at every prefill:decode ratio, and dynamic; each mode at its best "
        "ratio",
    )
    pd.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=slo.ttft_ms,
        help="time to first token target (default %(default)g: MLPerf's Llama-3.1-8B server)",
    )
    pd.add_argument(
        "--slo-itl-ms",
        type=float,
        default=slo.itl_ms,
        help="mean inter-token latency target per request (default %(default)g: MLPerf's "
        "Llama-3.1-8B server TPOT)",
    )
    pd.add_argument(
        "--loads",
        default="0.5,0.8,1.0,1.2",
        help="--pd-sweep's loads, fractions of the estimated capacity (default %(default)s)",
    )
    pd.add_argument(
        "--pd-stall-weight",
        type=float,
        default=None,
        help="decide's weight of the decode streams' loss (default: from the SLO and the mean "
        "answer)",
    )
    pd.add_argument(
        "--no-pd-prefetch",
        action="store_true",
        help="a hand-off's decode worker pulls from the first token on, not while the prefill "
        "runs (the router's pd_prefetch off)",
    )
    pd.add_argument(
        "--admit-ttft-ms",
        type=float,
        default=None,
        help="the router's admission in every mode: refuse a request predicted to wait longer "
        "than this for its first token (default: admit every request); refused requests count "
        "against goodput",
    )
    pd.add_argument(
        "--admit-itl-ms",
        type=float,
        default=None,
        help="the router's admission in every mode: refuse as well a request that would join "
        "or stall the streams of a worker lately decoding them slower than this between "
        "tokens (default: never)",
    )
    pd.add_argument(
        "--pd-decide-slo",
        action="store_true",
        help="decide also against the router's latency targets (pd_ttft_slo_ms, "
        "pd_itl_slo_ms), set to --slo-ttft-ms and --slo-itl-ms",
    )


def pd_options(args: argparse.Namespace) -> dict[str, Any]:
    """The P/D fields of `SimulateArgs` from the flags; a bad value is a `CliError` naming
    its flag."""
    from cachesvc.sim.goodput import SLO

    for flag in ("admit_ttft_ms", "admit_itl_ms"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise CliError(f"--{flag.replace('_', '-')} must be positive, got {value:g}")
    loads = numbers(args.loads, "--loads", float)
    if not loads or min(loads) <= 0:
        raise CliError(f"--loads takes positive fractions of the capacity, got {args.loads}")
    return {
        "pd": args.pd,
        "prefill_workers": args.prefill_workers,
        "pd_sweep": args.pd_sweep,
        "slo": SLO(args.slo_ttft_ms, args.slo_itl_ms),
        "loads": loads,
        "stall_weight": args.pd_stall_weight,
        "pd_decide_slo": args.pd_decide_slo,
        "pd_prefetch": not args.no_pd_prefetch,
        "admit_ttft_ms": args.admit_ttft_ms,
        "admit_itl_ms": args.admit_itl_ms,
    }
