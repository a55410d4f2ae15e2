"""`cachesvc simulate --like-bench-pd`: the requests `cachesvc bench pd` sends
(`cachesvc.bench.pd_workload`), replayed in the simulator on the bench's two setups, with the
router's defaults: its policy, and with a prefill worker its per-request decision
(`pd_mode="auto"`, the simulator's `decide`, at the router's stall weight) or `always`.

Each phase runs on a fresh cluster of two workers of the bench's size (the live phases run one
after the other on the same workers, but no request shares a block with another, so nothing
cached carries over). What is reported is what the live bench reports, as the client sees it:
the decodes' inter-token gaps and the long prompts' time to first token, in the bench's own
`PhaseResult`s, so one table prints both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from cachesvc.bench.pd import PhaseResult, format_results
from cachesvc.bench.pd_workload import (
    ALONE,
    BLOCK_SIZE,
    NUM_WORKERS,
    SETUPS,
    WITH_PROMPTS,
    PDShape,
    phase_requests,
)
from cachesvc.bench.table import write_json
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.goodput import outcomes
from cachesvc.sim.loop import ClusterSpec, PDSetup, SimRun, replay
from cachesvc.sim.pd import ALWAYS, COLOCATED, DECIDE
from cachesvc.sim.simulate import SimulateArgs, profile_for
from cachesvc.sim.trace import BENCH_VOCAB_SIZE, SimRequest
from router.pd import SLO as TargetsSLO
from router.policy import PEER

# The router's pd_mode -> the simulator's mode with a prefill worker.
PD_MODES = {"auto": DECIDE, "always": ALWAYS}
ROUTER_MODES = {mode: pd_mode for pd_mode, mode in PD_MODES.items()}


def phase_sim_requests(shape: PDShape, phase: str) -> list[SimRequest]:
    """The requests of one phase, as the default model's workers hash their tokens."""
    root = root_hash("simulated", BLOCK_SIZE)
    return [
        SimRequest(
            index=i,
            arrival_s=r.offset_s,
            prompt_len=len(r.prompt_ids),
            output_len=r.max_tokens,
            hashes=tuple(hash_blocks(list(r.prompt_ids), BLOCK_SIZE, root)),
            block_size=BLOCK_SIZE,
        )
        for i, r in enumerate(phase_requests(shape, phase, BENCH_VOCAB_SIZE))
    ]


def replay_bench_pd(
    profile: CostProfile,
    shape: PDShape,
    pd_mode: str = "auto",
    itl_slo_ms: float | None = None,
    policy_options: Mapping[str, Any] | None = None,
) -> list[PhaseResult]:
    """Both setups' phases, simulated (pure); in the live bench's order. `itl_slo_ms` is the
    router's inter-token target for its decisions (`bench pd --itl-slo-ms`)."""
    from router.config import RouterConfig

    router = RouterConfig(pd_mode=pd_mode, pd_itl_slo_ms=itl_slo_ms)
    options = router.policy_options() if policy_options is None else policy_options
    spec = ClusterSpec(NUM_WORKERS, device_blocks=shape.num_blocks, block_size=BLOCK_SIZE)
    targets = None if itl_slo_ms is None else TargetsSLO(None, itl_slo_ms / 1e3)
    results = []
    for setup, (num_prefill, _) in SETUPS.items():
        mode = PD_MODES[pd_mode] if num_prefill else COLOCATED
        pd = PDSetup(mode, num_prefill, router.pd_stall_weight, targets)
        for phase in (ALONE, WITH_PROMPTS):
            requests = phase_sim_requests(shape, phase)
            # The router names holders (its peer_pull) and the workers pull, as in the bench.
            run = replay(requests, profile, spec, router.policy, options, True, pd)
            results.append(phase_result(run, requests, setup, phase, shape.streams))
    return results


def phase_result(
    run: SimRun, requests: Sequence[SimRequest], setup: str, phase: str, num_streams: int
) -> PhaseResult:
    """What the client saw of one replayed phase: the first `num_streams` requests are the
    decode streams, the rest the long prompts."""
    result = PhaseResult(setup, phase)
    hop_s = run.workers[0].profile.hop_s  # the engine's TTFT is the client's less the hop
    for outcome in outcomes(run):
        if outcome.index < num_streams:
            result.gaps_s += outcome.gaps_s
            continue
        result.ttft_s.append(outcome.ttft_s)
        result.worker_ttft_s.append(outcome.ttft_s - hop_s)
        if outcome.disaggregated:
            result.disaggregated += 1
    pulled = [s.cached.get(PEER, 0) for s in run.seqs if s.pulls_prompt]
    result.kv_moved_tokens = sum(pulled)
    assert len(result.ttft_s) == len(requests) - num_streams, "every long prompt is served"
    return result


def run_like_bench_pd(args: SimulateArgs) -> int:
    """Blocking entry point of `cachesvc simulate --like-bench-pd`: prints the bench's table,
    simulated; returns 0."""
    mode = args.pd or DECIDE
    if mode not in ROUTER_MODES:
        raise ValueError(f"--like-bench-pd takes --pd {DECIDE} (the router's auto) or {ALWAYS}")
    shape = PDShape(args.quick)
    # As bench pd's --itl-slo-ms: the router's inter-token target alone.
    itl = args.slo.itl_ms if args.pd_decide_slo else None
    results = replay_bench_pd(profile_for(args), shape, ROUTER_MODES[mode], itl)
    live = "cachesvc bench pd" + (" --quick" if args.quick else "")
    print(format_results(results))
    print(f"simulated ({args.profile}); `{live}` serves the same requests live")
    write_json(args.json_path, [dataclasses.asdict(r) for r in results])
    return 0
