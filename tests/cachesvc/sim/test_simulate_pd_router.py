"""The simulator decides a prefill/decode plan as the router does (`router.request.disagg`): the
prompt runs on the prefill worker whose first token comes soonest (`fastest_prefill`), not on the
policy's choice, and the policy records only the worker a request runs on."""

from __future__ import annotations

from sim_support import UNIT, WriteTrace

from cachesvc.kv.types import WorkerId
from cachesvc.sim.loop import ClusterSpec, PDSetup, replay
from cachesvc.sim.pd import ALWAYS
from cachesvc.sim.trace import BLOCK_SIZE, load_trace
from router.policy.costs import Candidate, RouteRequest
from router.policy.routing import Policy, RouteDecision, make_policy

SPEC = ClusterSpec(3, device_blocks=256)  # w0 and w1 prefill, w2 decodes


class Recorded:
    """Round robin, keeping the workers it is told requests run on."""

    def __init__(self) -> None:
        self.policy: Policy = make_policy("round_robin")
        self.name = self.policy.name
        self.asked = 0
        self.recorded: list[WorkerId] = []

    def choose(self, request: RouteRequest, candidates: list[Candidate]) -> RouteDecision:
        self.asked += 1
        return self.policy.choose(request, candidates)

    def record(self, request: RouteRequest, candidates: list[Candidate], worker: WorkerId) -> None:
        self.recorded.append(worker)
        self.policy.record(request, candidates, worker)


def test_the_prompt_runs_where_its_first_token_comes_soonest(write_trace: WriteTrace) -> None:
    """Three prompts 5 s apart (each computed in 2 s), sharing their first 4 blocks: w0
    computed them, so the later prompts' first tokens come soonest there (round robin among
    the prefill workers would have sent the second to w1). The policy is asked once a request,
    for the colocated side, and records the decode worker each request runs on."""
    prompt = 4 * BLOCK_SIZE + 10
    rows = [(i * 5000, prompt, 4, [1, 2, 3, 4, 10 + i]) for i in range(3)]
    requests = load_trace(write_trace(rows))
    policy = Recorded()
    run = replay(requests, UNIT, SPEC, policy, pd=PDSetup(ALWAYS, 2))  # type: ignore[arg-type]
    assert [run.assigned[i] for i in range(3)] == ["w0", "w0", "w0"]
    assert policy.asked == 3 and policy.recorded == ["w2", "w2", "w2"]
    prefills = [s for s in run.seqs if s.prefill_only]
    assert [s.cached.get("hbm", 0) for s in prefills] == [0, 4 * BLOCK_SIZE, 4 * BLOCK_SIZE]
