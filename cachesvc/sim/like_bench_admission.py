"""`cachesvc simulate --like-bench-admission`: what `cachesvc bench admission` sends, replayed in
the simulator, to set its conclusions about admission against a live run.

As the live bench: two mixed workers (`prefix_aware`, no pulls); three warm-up prompts one at
a time, whose median TTFT sets the capacity (two workers serve two per median); then a burst
of prompts of their own at `overload` times that capacity for `seconds`, four tokens each
(with an inter-token target, the bench's longer answers), served without and then with
admission at the TTFT target (and then on the streams too). Each setup is one replay of the
warm-ups and the burst on a fresh cluster; the figures are the burst's, the table the bench's.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Sequence

from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.sim.cost_profile import CostProfile
from cachesvc.sim.loop import ClusterSpec, PDSetup, SimRun, replay
from cachesvc.sim.pd import COLOCATED
from cachesvc.sim.simulate import SimulateArgs, profile_for
from cachesvc.sim.trace import SimRequest
from cachesvc.workloads.admission import (
    MAX_TOKENS,
    NUM_WORKERS,
    WARMUPS,
    AdmissionBenchArgs,
    SetupResult,
    format_results,
    mean_gap_s,
)
from cachesvc.workloads.table import write_json
from router.policy.admission import admission_targets

BLOCK_SIZE = 16  # the live engine's default
DEVICE_BLOCKS = 4096  # room for every prompt of the burst: the bench never evicts to matter
WARMUP_GAP_S = 10.0  # the warm-ups one at a time: each long done before the next
VOCAB = 49152  # the default model's: prompts of their own, as the bench draws them


def _request(
    index: int, arrival_s: float, num_tokens: int, max_tokens: int = MAX_TOKENS
) -> SimRequest:
    rng = random.Random(f"like-bench-admission-{index}")
    ids = [rng.randrange(3, VOCAB - 1) for _ in range(num_tokens)]
    hashes = hash_blocks(ids, BLOCK_SIZE, root_hash("simulated", BLOCK_SIZE))
    return SimRequest(index, arrival_s, num_tokens, max_tokens, tuple(hashes), BLOCK_SIZE)


def _warmups(num_tokens: int) -> list[SimRequest]:
    return [_request(i, i * WARMUP_GAP_S, num_tokens) for i in range(WARMUPS)]


def _ttfts(run: SimRun) -> dict[int, float]:
    return {s.req.index: s.token_times[0] - s.req.arrival_s for s in run.seqs if s.token_times}


def replay_bench_admission(profile: CostProfile, args: AdmissionBenchArgs) -> list[SetupResult]:
    """Every setup of the bench, simulated (pure)."""
    spec = ClusterSpec(NUM_WORKERS, DEVICE_BLOCKS, block_size=BLOCK_SIZE)
    warm = _warmups(args.num_tokens)
    alone = _ttfts(replay(warm, profile, spec, "prefix_aware", pd=PDSetup(COLOCATED)))
    rate = args.overload * NUM_WORKERS / statistics.median(alone[r.index] for r in warm)
    start_s = WARMUPS * WARMUP_GAP_S
    count = args.burst_size(rate)
    burst = [
        _request(WARMUPS + i, start_s + i / rate, args.num_tokens, args.answer_tokens)
        for i in range(count)
    ]
    results = []
    for setup in args.setups:
        pd = PDSetup(COLOCATED, admit=admission_targets(*args.targets(setup)))
        run = replay(warm + burst, profile, spec, "prefix_aware", pd=pd)
        results.append(_burst_result(run, burst, setup, rate, args))
    return results


def _burst_result(
    run: SimRun, burst: Sequence[SimRequest], setup: str, rate: float, args: AdmissionBenchArgs
) -> SetupResult:
    ttfts = _ttfts(run)
    gaps = {s.req.index: mean_gap_s(s.token_times) for s in run.seqs if s.token_times}
    refused = {r.index for r in run.refused}
    result = SetupResult(setup, rate, args.ttft_ms, itl_target_ms=args.itl_ms)
    result.refused = sum(r.index in refused for r in burst)
    result.ttft_s = [ttfts[r.index] for r in burst if r.index in ttfts]
    result.itl_s = [gaps[r.index] for r in burst if r.index in gaps]
    ends = [s.finish_s for s in run.seqs if s.req.index >= burst[0].index and s.finish_s]
    last = max([*ends, *(r.arrival_s for r in run.refused)], default=burst[0].arrival_s)
    result.span_s = last - burst[0].arrival_s
    return result


def run_like_bench_admission(args: SimulateArgs) -> int:
    """Blocking entry point of `cachesvc simulate --like-bench-admission`: the bench's table,
    simulated; returns 0."""
    admit_ms = args.admit_ttft_ms or AdmissionBenchArgs().ttft_ms
    bench = AdmissionBenchArgs(quick=args.quick, ttft_ms=admit_ms, itl_ms=args.admit_itl_ms)
    results = replay_bench_admission(profile_for(args), bench)
    live = "cachesvc bench admission" + (" --quick" if args.quick else "")
    print(format_results(results))
    print(f"simulated ({args.profile}); `{live}` serves the same requests live")
    write_json(
        args.json_path, [{**dataclasses.asdict(r), "goodput_rps": r.goodput_rps} for r in results]
    )
    return 0
