"""The router's P/D plan and prefill phase (`router.request.disagg.Disaggregation`) over a pool of
workers with roles, their loads set as polls would set them: the policy is asked once a
request and records only the worker that serves it (a hand-off's decode worker, at the cost of
its pull), nothing for a refused request, and keeps the objects it holds; a first token that
ends the request at the model's context ends it there (no hand-off, `length`); the decode
side's in-flight count returns whatever the prefill phase raises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import pytest

from cachesvc.kv.index import MemoryPrefixIndex
from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.metrics import RequestOutcome, RouterMetrics
from router.policy.costs import PEER, Candidate, RouteRequest
from router.policy.routing import Policy, PrefixAware, RouteDecision, make_policy
from router.pool.worker_pool import ModelInfo, WorkerPool
from router.request.disagg import Disaggregation
from router.request.handoff import Handoff
from router.request.placement import Placement
from router.request.resume import Part, RequestProgress
from workers.protocol import BlockCosts, StreamDelta, Usage, WorkerInfo, WorkerLoad

BLOCK, CONTEXT = 4, 64
P0, D0, D1 = WorkerId("prefill-0"), WorkerId("decode-0"), WorkerId("decode-1")
ROLES = {P0: "prefill", D0: "decode", D1: "decode"}
COSTS = BlockCosts(compute_s=4e-3, fetch_s={PEER: 1e-3})


class Counted:
    """A policy that keeps, in lists of its own, each request it is asked about and each
    worker it is told a request runs on, with that worker's candidate as recorded."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.name = policy.name
        self.asked: list[RouteRequest] = []
        self.recorded: list[Candidate] = []

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision:
        self.asked.append(request)
        return self.policy.choose(request, candidates)

    def record(
        self, request: RouteRequest, candidates: Sequence[Candidate], worker: WorkerId
    ) -> None:
        self.recorded.append(next(c for c in candidates if c.worker == worker))
        self.policy.record(request, candidates, worker)


class NoPrefetch:
    """A decode worker's handle whose prefetch cannot even be sent (its call raises)."""

    class _Method:
        def remote(self, *args: Any) -> Any:
            raise RuntimeError("the prefetch could not be sent")

    prefetch = _Method()


def _pool(actors: dict[WorkerId, Any] | None = None) -> WorkerPool:
    actors = actors or {}
    pool = WorkerPool({w: actors.get(w) for w in ROLES}, MemoryPrefixIndex(), RouterConfig())
    pool._model = ModelInfo("tiny", BLOCK, 320, CONTEXT)
    for state in pool.states():
        worker = state.worker_id
        state.info = WorkerInfo(
            worker, "1", "tiny", BLOCK, 320, CONTEXT, "cpu", None, f"a-{worker}", role=ROLES[worker]
        )
        state.load = WorkerLoad(block_costs=COSTS)
    return pool


def _disaggregation(
    policy: Policy, pool: WorkerPool | None = None, **config: Any
) -> Disaggregation:
    pool = pool or _pool()
    router_config = RouterConfig(**{"pd_mode": "always", "pd_prefetch": False, **config})
    placement = Placement(pool, policy, router_config)
    return Disaggregation(pool, placement, router_config, RouterMetrics())


def _progress(num_tokens: int, max_tokens: int) -> RequestProgress:
    ids = [3 + (7 * j) % 300 for j in range(num_tokens)]
    return RequestProgress(ids, {"max_tokens": max_tokens, "temperature": 0.0}, None)


def test_the_policy_is_asked_once_and_records_only_the_decode_worker() -> None:
    """Handed off, a request runs neither its prompt nor its decode where the policy would
    have put it colocated (decode-0 decodes more streams: decode-1 decodes it): the policy
    records decode-1, pulling the prompt's 5 full blocks, never decode-0 nor the prefill
    worker, so round robin's next choice is decode-0 again. What the policy keeps of its own
    is its own: nothing is put back from a copy."""
    pool = _pool()
    pool.state(D0).load = WorkerLoad(num_running=3, block_costs=COSTS)
    policy = Counted(make_policy("round_robin"))
    pd = _disaggregation(policy, pool)
    picks = []
    for _ in range(3):
        handoff = pd.plan(_progress(20, 8), [], set())
        assert handoff is not None and handoff.decision.disaggregate
        assert handoff.prefill is not None and handoff.prefill.worker == P0
        assert handoff.decode == D1
        picks.append(handoff.colocated.decision.worker)
    assert len(policy.asked) == 3
    assert picks == [D0, D0, D0]
    assert [c.worker for c in policy.recorded] == [D1, D1, D1]
    assert all(c.peer_blocks == 20 // BLOCK for c in policy.recorded), "its prefill is a pull"


def test_prefix_aware_is_charged_the_decode_workers_pull_not_the_prompt() -> None:
    """prefix_aware remembers the prefill tokens each worker was given: for a hand-off, the
    decode worker's pull of the 5 full blocks (a quarter of a token each, at its costs) and
    the tail it computes, not the prompt's 20 tokens."""
    pool = _pool()
    pool.state(D0).load = WorkerLoad(num_running=3, block_costs=COSTS)
    policy = make_policy("prefix_aware")
    pd = _disaggregation(policy, pool)
    handoff = pd.plan(_progress(20, 8), [], set())
    assert handoff is not None and handoff.decode == D1
    assert isinstance(policy, PrefixAware)
    # 19 tokens pulled at most (the engine computes the last): 4 blocks and 3 tokens.
    assert policy._work.get(D1) == pytest.approx(1 + 19 * 0.25)
    assert policy._work.get(D0) == 0.0 and policy._traffic.get(D0) == 0.0


def test_a_request_kept_colocated_is_recorded_there() -> None:
    policy = Counted(make_policy("round_robin"))
    pd = _disaggregation(policy, pd_mode="auto", pd_ttft_slo_ms=1e6, pd_itl_slo_ms=1e6)
    picks = []
    for _ in range(2):
        handoff = pd.plan(_progress(20, 8), [], set())
        assert handoff is not None and not handoff.decision.disaggregate
        picks.append(handoff.colocated.decision.worker)
    assert len(policy.asked) == 2 and picks == [D0, D1]
    assert [c.worker for c in policy.recorded] == [D0, D1]
    assert [c.peer_blocks for c in policy.recorded] == [0, 0]


def test_a_refused_request_is_recorded_nowhere() -> None:
    policy = Counted(make_policy("round_robin"))
    pd = _disaggregation(policy)

    def refuse(decision: object, stalls: object) -> None:
        raise RuntimeError("refused")

    with pytest.raises(RuntimeError, match="refused"):
        pd.plan(_progress(20, 8), [], set(), refuse)
    assert len(policy.asked) == 1 and policy.recorded == []
    handoff = pd.plan(_progress(20, 8), [], set())
    assert handoff is not None and handoff.colocated.decision.worker == D0


def test_a_request_its_first_token_ends_is_recorded_on_no_decode_worker() -> None:
    """A prompt one token short of the context runs on the prefill worker alone, which the
    policy does not choose among: it records nothing."""
    policy = Counted(make_policy("round_robin"))
    pd = _disaggregation(policy)
    handoff = pd.plan(_progress(CONTEXT - 1, 8), [], set())
    assert handoff is not None and handoff.decision.disaggregate
    assert len(policy.asked) == 1 and policy.recorded == []


def test_between_mixed_workers_the_decode_worker_is_recorded() -> None:
    """Between mixed workers the prompt runs on the policy's choice and the decode on the
    other: that one is recorded, so round robin's choice stays where the prompts run."""
    mixed = {W: "mixed" for W in (D0, D1)}
    pool = WorkerPool({w: None for w in mixed}, MemoryPrefixIndex(), RouterConfig())
    pool._model = ModelInfo("tiny", BLOCK, 320, CONTEXT)
    for state in pool.states():
        state.info = WorkerInfo(
            state.worker_id, "1", "tiny", BLOCK, 320, CONTEXT, "cpu", None, "a", role="mixed"
        )
        state.load = WorkerLoad(block_costs=COSTS)
    policy = Counted(make_policy("round_robin"))
    pd = _disaggregation(policy, pool, pd_mixed=True)
    for _ in range(2):
        handoff = pd.plan(_progress(20, 8), [], set())
        assert handoff is not None and handoff.decision.disaggregate
        assert handoff.prefill is not None and handoff.prefill.worker == D0
        assert handoff.decode == D1
    assert [c.worker for c in policy.recorded] == [D1, D1]


async def _run_prefill(
    pd: Disaggregation, handoff: Handoff, progress: RequestProgress, deltas: list[StreamDelta]
) -> tuple[list[StreamDelta], list[bool]]:
    holds: list[bool] = []

    async def part_stream(
        decision: RouteDecision, part: Part, request_id: str, req: Any, hold_kv: bool = False
    ) -> AsyncGenerator[StreamDelta, None]:
        holds.append(hold_kv)
        for delta in deltas:
            yield delta

    class Req:
        cache_salt = None

    outcome = RequestOutcome("r", "round_robin")
    got = [
        d
        async for d in pd.prefill(
            handoff, progress, "r", outcome, part_stream, lambda usage: None, Req()
        )
    ]
    return got, holds


def _usage(worker: WorkerId, prompt_tokens: int) -> Usage:
    return Usage(prompt_tokens, 1, {}, prompt_tokens, 1.0, None, worker)


def test_a_first_token_at_the_end_of_the_context_ends_the_request_there() -> None:
    """A prompt of max_model_len - 1 tokens: its first token fills the context, as colocated
    serving it ends with `length` on the prefill worker; no decode worker is asked for more."""
    pd = _disaggregation(make_policy("round_robin"))
    progress = _progress(CONTEXT - 1, 8)
    handoff = pd.plan(progress, [], set())
    assert handoff is not None and handoff.decision.disaggregate
    last = StreamDelta(0, (42,), "", "length", _usage(P0, CONTEXT - 1))
    got, holds = asyncio.run(_run_prefill(pd, handoff, progress, [last]))
    assert [d.finish_reason for d in got] == ["length"]
    assert got[-1].usage is not None and got[-1].usage.worker_id == P0
    assert all(sample.finished for sample in progress.samples)
    assert not handoff.handed_off and handoff.take() is None
    assert holds == [False]  # nothing kept pinned for a pull that cannot come


def test_a_first_token_before_the_end_of_the_context_is_handed_off() -> None:
    pd = _disaggregation(make_policy("round_robin"))
    progress = _progress(CONTEXT - 3, 8)
    handoff = pd.plan(progress, [], set())
    assert handoff is not None
    last = StreamDelta(0, (42,), "", "length", _usage(P0, CONTEXT - 3))
    got, holds = asyncio.run(_run_prefill(pd, handoff, progress, [last]))
    assert [d.finish_reason for d in got] == [None]
    assert handoff.handed_off and holds == [True]
    placed = handoff.take()
    assert placed is not None and placed.decision.worker == handoff.decode


def test_the_decode_sides_inflight_count_returns_when_the_prefill_phase_raises() -> None:
    pool = _pool({D0: NoPrefetch(), D1: NoPrefetch()})
    pd = _disaggregation(make_policy("round_robin"), pool, pd_prefetch=True)
    progress = _progress(20, 8)
    handoff = pd.plan(progress, [], set())
    assert handoff is not None and handoff.decode is not None
    with pytest.raises(RuntimeError, match="could not be sent"):
        asyncio.run(_run_prefill(pd, handoff, progress, []))
    assert [s.num_inflight for s in pool.states()] == [0, 0, 0]
