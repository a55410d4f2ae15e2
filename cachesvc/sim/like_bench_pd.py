"""`cachesvc simulate --like-bench-pd`: the requests `cachesvc bench pd` sends
(`cachesvc.workloads.pd`), replayed in the simulator on the bench's two setups, with the
router's defaults: its policy, and with a prefill worker its per-request decision
(`pd_mode="auto"`, the simulator's `decide`, at the router's stall weight) or `always`.

As live, a setup's cluster (two workers of the bench's size) and router serve the warm-up
request, then the first phase once the warm-up's last token is out, then the second once the
first's is: what the router remembers of each (the busy seconds its policy breaks ties on) is
there for the next. What is reported is what the live bench reports, as the client sees it: the
decodes' inter-token gaps and the long prompts' time to first token, in the bench's own
`PhaseResult`s, so one table prints both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.types import WorkerId
from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.goodput import Outcome, outcomes
from cachesvc.sim.loop import ClusterSpec, PDSetup, replay
from cachesvc.sim.pd import ALWAYS, COLOCATED, DECIDE
from cachesvc.sim.simulate import SimulateArgs, profile_for
from cachesvc.sim.trace import BENCH_VOCAB_SIZE as VOCAB
from cachesvc.sim.trace import SimRequest
from cachesvc.workloads.pd import (
    ALONE,
    BLOCK_SIZE,
    NUM_WORKERS,
    SETUPS,
    WITH_PROMPTS,
    PDBenchArgs,
    PDRequest,
    PDShape,
    PhaseResult,
    format_results,
    phase_requests,
    warmup_request,
)
from cachesvc.workloads.table import write_json
from router.policy.pd import SLO as TargetsSLO
from router.policy.routing import PEER, Candidate, Policy, RouteDecision, RouteRequest, make_policy

# The router's pd_mode -> the simulator's mode with a prefill worker.
PD_MODES = {"auto": DECIDE, "always": ALWAYS}
ROUTER_MODES = {mode: pd_mode for pd_mode, mode in PD_MODES.items()}


def phase_sim_requests(shape: PDShape, phase: str, start_s: float = 0.0) -> list[SimRequest]:
    """The requests of one phase sent from `start_s`, as the default model's workers hash
    their tokens."""
    return [_sim_request(i, start_s, r) for i, r in enumerate(phase_requests(shape, phase, VOCAB))]


def _sim_request(index: int, start_s: float, request: PDRequest, timed: bool = True) -> SimRequest:
    ids = list(request.prompt_ids)
    return SimRequest(
        index=index,
        arrival_s=start_s + request.offset_s,
        prompt_len=len(ids),
        output_len=request.max_tokens,
        hashes=tuple(hash_blocks(ids, BLOCK_SIZE, root_hash("simulated", BLOCK_SIZE))),
        block_size=BLOCK_SIZE,
        timed=timed,
    )


# The live bench warms each worker with a prompt of its own, sent to it directly, one after the
# other (`bench.pd._warm_workers`), just before the router's first request.
LAST_WARMED = WorkerId(f"w{NUM_WORKERS - 1}")


class PolledLate:
    """`policy`, but its first decision sees `worker` with a request: the worker warmed last
    has just finished its prompt, and the router's poll of it (every 50 ms) still shows it.
    So the policy counts that worker busy from then until its next decision, as it counts the
    one the first request goes to, and the two decode streams that follow go one to each: live
    they did in every quiet run, and without this the simulated router put both on one worker
    (their steps of two sequences, 1.4x a gap of one). The first decision lasts until it is
    recorded: the policy both chooses and records over what that poll showed."""

    def __init__(self, policy: Policy, worker: WorkerId) -> None:
        self.policy = policy
        self.worker = worker
        self.name = policy.name
        self._first = True

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        return self.policy.choose(request, self._polled(candidates))

    def record(
        self, request: RouteRequest, candidates: Sequence[Candidate], worker: WorkerId
    ) -> None:
        polled = self._polled(candidates)
        self._first = False
        self.policy.record(request, polled, worker)

    def _polled(self, candidates: Sequence[Candidate]) -> Sequence[Candidate]:
        if not self._first:
            return candidates
        return [
            dataclasses.replace(c, num_requests=max(1, c.num_requests))
            if c.worker == self.worker
            else c
            for c in candidates
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
        # As the live bench runs its prefill worker (`PDBenchArgs`), and as the router pulls.
        chunk = PDBenchArgs.prefill_chunk_tokens
        pd = PDSetup(mode, num_prefill, router.pd_stall_weight, targets, router.pd_prefetch, chunk)
        requests = [_sim_request(0, 0.0, warmup_request(VOCAB), timed=False)]
        phases = {}

        def policy() -> Policy:
            return PolledLate(make_policy(router.policy, **options), LAST_WARMED)

        for phase in (ALONE, WITH_PROMPTS):
            # The router names holders (its peer_pull) and the workers pull, as in the bench.
            run = replay(requests, profile, spec, policy(), options, True, pd)
            # A phase starts once the client has every token of what came before.
            start_s = max(s.token_times[-1] for s in run.seqs)
            added = phase_sim_requests(shape, phase, start_s)
            phases[phase] = range(len(requests), len(requests) + len(added))
            requests += [dataclasses.replace(r, index=r.index + len(requests)) for r in added]
        run = replay(requests, profile, spec, policy(), options, True, pd)
        done = {o.index: o for o in outcomes(run)}
        pulled = {s.req.index: s.cached.get(PEER, 0) for s in run.seqs if s.pulls_prompt}
        for phase, indexes in phases.items():
            result = PhaseResult(setup, phase)
            add_phase(result, done, pulled, indexes, shape.streams, profile.hop_s)
            results.append(result)
    return results


def add_phase(
    result: PhaseResult,
    done: Mapping[int, Outcome],
    pulled: Mapping[int, int],
    indexes: range,
    num_streams: int,
    hop_s: float = 0.0,
) -> None:
    """Add to `result` what the client saw of one phase (`done`: every request's outcome;
    `pulled`: the prompt tokens each hand-off pulled): its requests are `indexes`, the first
    `num_streams` of them decode streams, the rest long prompts (their engine-side TTFT is
    `hop_s` shorter)."""
    for index in indexes:
        outcome = done[index]
        if index < indexes.start + num_streams:
            result.gaps_s += outcome.gaps_s
            continue
        result.ttft_s.append(outcome.ttft_s)
        result.worker_ttft_s.append(outcome.ttft_s - hop_s)
        result.disaggregated += outcome.disaggregated
        result.kv_moved_tokens += pulled.get(index, 0)


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
