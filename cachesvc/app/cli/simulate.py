"""`cachesvc simulate`: replay a Mooncake trace (or the hot-prefix workload) through the router's
policies without a model; `cachesvc simulate calibrate` measures a cost profile of this machine
for it."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from cachesvc.app.cli.common import CliError, numbers
from cachesvc.app.cli.simulate_eviction import add_eviction_parser, run_eviction_command
from cachesvc.app.cli.simulate_pd import add_pd_arguments, pd_options

# The routing thresholds of `RouterConfig` that `cachesvc simulate` takes as flags.
_POLICY_FIELDS = (
    "balance_abs_threshold",
    "balance_rel_threshold",
    "balance_queue_factor",
    "balance_queue_slack_s",
    "balance_traffic_factor",
    "route_queue_weight",
    "route_tie_fraction",
    "route_work_half_life_s",
    "route_busy_weight",
    "route_busy_half_life_s",
)


def add_simulate_parser(sub: Any) -> None:
    """Register `simulate` (and `simulate calibrate`) on the CLI's subparsers."""
    from cachesvc.sim.generate import GeneratedTrace
    from cachesvc.sim.trace import HotPrefix
    from router.config import RouterConfig

    sim = sub.add_parser(
        "simulate",
        help="replay a Mooncake trace (or hot-prefix) through the routing policies, no model",
        description="Replay a Mooncake JSONL trace at full size (or the hot-prefix workload) "
        "through the router's policies, prefix index and block pools; time comes from a cost "
        "profile. Sizes are blocks of the workload (512 tokens in a trace, 16 in hot-prefix) "
        "or a percentage of its unique blocks (e.g. 5%).",
    )
    actions = sim.add_subparsers(dest="action")
    add_eviction_parser(actions)
    cal = actions.add_parser("calibrate", help="measure a cost profile on this machine")
    cal.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2)")
    cal.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (default 1: steady timings)"
    )
    cal.add_argument("--out", default=None, help="profile file (default: profiles/cpu-calibrated)")
    cal.add_argument(
        "--no-live",
        action="store_true",
        help="the engine's steps only: skip the live path's terms (a router and 2 Ray workers)",
    )
    cal.add_argument(
        "--live-only",
        action="store_true",
        help="the live path's terms only, added to the profile --out names (or the stored one)",
    )

    sim.add_argument(
        "--workload",
        default="trace",
        choices=("trace", "hot-prefix", "generated"),
        help="trace (default): replay --trace; hot-prefix: one long context forked into many "
        "sub-agent requests, compared by default over affinity only, load only and with pulls; "
        "generated: conversations and agents drawn at --rate-per-worker, so a sweep over "
        "workers keeps the load per worker",
    )
    sim.add_argument("--trace", help="a Mooncake JSONL trace (timestamp, lengths, hash_ids)")
    sim.add_argument("--profile", default="h100-llama3-8b", help="stored profile name or a file")
    sim.add_argument("--workers", type=int, default=8)
    sim.add_argument(
        "--device-blocks",
        default=None,
        help="device KV blocks per worker (default 5%% for a trace, 4096 for hot-prefix)",
    )
    sim.add_argument("--dram-blocks", default="0", help="DRAM tier blocks per worker")
    sim.add_argument("--nvme-blocks", default="0", help="NVMe tier blocks per worker")
    sim.add_argument(
        "--policy",
        action="append",
        default=None,
        help="a policy to run, NAME or NAME+pull for workers that pull prefixes from each other "
        "(repeat; default: all for a trace, longest_prefix, least_loaded, least_loaded+pull "
        "and prefix_aware+pull for hot-prefix)",
    )
    sim.add_argument("--peer-pull", action="store_true", help="run every policy with pulls as well")
    sim.add_argument(
        "--peer-gbps",
        type=float,
        default=None,
        help="bandwidth of a pull between workers in GB/s (default: the profile's, else the "
        "workers' prior of 1 GB/s after 5 ms)",
    )
    sim.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times by this (0.5 replays at twice the trace's rate)",
    )
    sim.add_argument(
        "--scale-arrivals",
        type=int,
        default=None,
        metavar="N",
        help="give every cluster the load per worker N workers get from the trace: arrivals "
        "compressed by workers/N (on top of --time-scale), e.g. 8 with --sweep workers=8,32,128",
    )
    sim.add_argument(
        "--scale-users",
        type=int,
        default=None,
        metavar="N",
        help="give every cluster the load per worker N workers get from the trace by replaying "
        "workers/N copies of its users, each with its own hash ids (more sessions, each at the "
        "trace's pace), e.g. 8 with --sweep workers=8,32,128; instead of --scale-arrivals",
    )
    sim.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="replay the first N only (of the original trace, before --scale-users copies it)",
    )
    sim.add_argument(
        "--like-bench-routing",
        action="store_true",
        help="replay what `cachesvc bench routing --workload trace` sends for this trace "
        "(a scaled-down sample, 16-token blocks) rather than the full trace",
    )
    sim.add_argument(
        "--like-bench-pd",
        action="store_true",
        help="replay what `cachesvc bench pd` sends, on its two setups (2 mixed workers; 1 "
        "prefill + 1 decode, decided per request as the router's pd_mode auto, or --pd always; "
        "with --pd-decide-slo the router's inter-token target is --slo-itl-ms, as the bench's "
        "--itl-slo-ms)",
    )
    sim.add_argument(
        "--like-bench-admission",
        action="store_true",
        help="replay what `cachesvc bench admission` sends (2 mixed workers, a burst at twice "
        "the capacity, without and with admission at --admit-ttft-ms, default the bench's)",
    )
    sim.add_argument(
        "--quick",
        action="store_true",
        help="with --like-bench-pd or --like-bench-admission: the bench's --quick sizes",
    )
    sim.add_argument(
        "--sweep",
        default=None,
        help="NAME=V1,V2,... over workers, device-blocks, dram-blocks or nvme-blocks",
    )
    sim.add_argument("--json", dest="json_path", help="also write the results to this file")
    sim.add_argument("--plot", dest="plot_path", help="also draw the results into this PNG")
    hot = HotPrefix()
    shape = sim.add_argument_group("hot-prefix workload")
    shape.add_argument("--prefix-len", type=int, default=hot.prefix_len, help="shared tokens")
    shape.add_argument("--num-forks", type=int, default=hot.num_forks, help="sub-agent requests")
    shape.add_argument("--suffix-len", type=int, default=hot.suffix_len, help="a fork's own tokens")
    shape.add_argument("--output-len", type=int, default=hot.output_len, help="tokens per answer")
    shape.add_argument(
        "--fork-at",
        type=float,
        default=hot.fork_at_s,
        help="seconds from the parent's end (as the profile predicts it) to the burst",
    )
    shape.add_argument("--rate", type=float, default=hot.rate, help="forks per second in the burst")
    gen = GeneratedTrace()
    made = sim.add_argument_group("generated workload")
    made.add_argument(
        "--rate-per-worker",
        type=float,
        default=gen.rate_per_worker,
        help="requests per second per worker",
    )
    made.add_argument(
        "--duration", type=float, default=gen.duration_s, help="seconds of session starts"
    )
    made.add_argument("--seed", type=int, default=gen.seed, help="the draw")
    made.add_argument(
        "--prompt-blocks",
        default=",".join(map(str, gen.first_blocks)),
        metavar="LO,HI",
        help="blocks of a session's own first message, uniform (default %(default)s; "
        "e.g. 16,48 for long documents)",
    )
    made.add_argument(
        "--mean-output", type=int, default=gen.mean_output, help="tokens per answer, mean"
    )
    made.add_argument(
        "--mean-turns",
        type=float,
        default=gen.mean_turns,
        help="requests per session, mean (1: every request a new session)",
    )
    made.add_argument(
        "--write-trace", default=None, help="also save the trace generated for --workers here"
    )
    add_pd_arguments(sim)
    defaults = RouterConfig()
    bounds = sim.add_argument_group("prefix_aware thresholds (RouterConfig fields)")
    for name in _POLICY_FIELDS:
        value = getattr(defaults, name)
        flag = "--" + name.replace("_", "-")
        bounds.add_argument(flag, type=type(value), default=value, help=f"default {value}")


def run_simulate_command(args: argparse.Namespace) -> int:
    if args.action == "calibrate":
        return _calibrate(args)
    if args.action == "eviction":
        return run_eviction_command(args)
    from cachesvc.sim.generate import GeneratedTrace
    from cachesvc.sim.pd_sweep import run_pd
    from cachesvc.sim.simulate import SimulateArgs, Size, run_simulate
    from cachesvc.sim.trace import HotPrefix
    from router.config import RouterConfig

    replays_bench = args.like_bench_pd or args.like_bench_admission
    if args.workload == "trace" and not args.trace and not replays_bench:
        raise CliError(
            "simulate needs --trace FILE (a Mooncake JSONL trace) or --workload hot-prefix"
        )
    if args.workers < 1:
        raise CliError(f"--workers must be positive, got {args.workers}")
    # The thresholds are validated as the router validates them.
    config = RouterConfig(**{name: getattr(args, name) for name in _POLICY_FIELDS})
    prompt_blocks = numbers(args.prompt_blocks, "--prompt-blocks")
    if len(prompt_blocks) != 2 or not 1 <= prompt_blocks[0] <= prompt_blocks[1]:
        raise CliError(f"--prompt-blocks takes LO,HI with 1 <= LO <= HI, got {args.prompt_blocks}")
    run = run_pd if args.pd is not None or args.pd_sweep else run_simulate
    if args.like_bench_pd:
        from cachesvc.sim.like_bench_pd import run_like_bench_pd

        run = run_like_bench_pd
    if args.like_bench_admission:
        from cachesvc.sim.like_bench_admission import run_like_bench_admission

        run = run_like_bench_admission
    return run(
        SimulateArgs(
            trace=args.trace,
            workload=args.workload,
            hot_prefix=HotPrefix(
                prefix_len=args.prefix_len,
                num_forks=args.num_forks,
                suffix_len=args.suffix_len,
                output_len=args.output_len,
                fork_at_s=args.fork_at,
                rate=args.rate,
            ),
            generated=GeneratedTrace(
                args.rate_per_worker,
                args.duration,
                args.seed,
                mean_turns=args.mean_turns,
                first_blocks=(prompt_blocks[0], prompt_blocks[1]),
                mean_output=args.mean_output,
            ),
            write_trace_path=args.write_trace,
            profile=args.profile,
            peer_gbps=args.peer_gbps,
            workers=args.workers,
            device_blocks=Size.parse(args.device_blocks) if args.device_blocks else None,
            dram_blocks=Size.parse(args.dram_blocks),
            nvme_blocks=Size.parse(args.nvme_blocks),
            policies=tuple(args.policy or ()),
            peer_pull=args.peer_pull,
            policy_options=config.policy_options(),
            time_scale=args.time_scale,
            scale_arrivals=args.scale_arrivals,
            scale_users=args.scale_users,
            max_requests=args.max_requests,
            sweep=args.sweep,
            json_path=args.json_path,
            plot_path=args.plot_path,
            like_bench_routing=args.like_bench_routing,
            like_bench_pd=args.like_bench_pd,
            quick=args.quick,
            **pd_options(args),
        )
    )


def _calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cachesvc.bench.calibrate.run import calibrate_profile
    from cachesvc.sim.cost_profile import PROFILE_DIR, load_profile, save_profile

    path = args.out or str(PROFILE_DIR / "cpu-calibrated.json")
    # What is not measured here (pulls) is kept from the profile replaced, else the stored one.
    base = load_profile(path if Path(path).is_file() else "cpu-calibrated")
    if args.no_live and args.live_only:
        raise CliError("--no-live and --live-only leave nothing to measure")
    profile = calibrate_profile(
        args.model, args.threads, base, live=not args.no_live, engine=not args.live_only
    )
    save_profile(profile, path)
    print(f"wrote {path}")
    for field in dataclasses.fields(profile):
        if field.name not in ("name", "description", "source"):
            print(f"  {field.name}: {getattr(profile, field.name)}")
    return 0
