"""Admission on the streams times a worker's gaps per sample: a stream of `n` samples brings
`n` deltas a step, and the gaps it reports are the steps', not a step over `n`."""

from __future__ import annotations

import pytest

from cachesvc.kv.index import MemoryPrefixIndex
from cachesvc.kv.types import WorkerId
from router.config import RouterConfig
from router.domain import Exhausted
from router.metrics import RequestOutcome, RouterMetrics
from router.policy.admission import Admission
from router.policy.answers import MeanAnswer
from router.pool.worker_pool import WorkerPool
from router.request.gate import Gate

W = WorkerId("w0")
STEP_S = 0.1


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


@pytest.mark.parametrize("n", [1, 4])
def test_a_streams_gaps_are_its_steps_whatever_its_samples(n: int) -> None:
    clock = Clock()
    pool = WorkerPool({W: None}, MemoryPrefixIndex(), RouterConfig())
    gate = Gate(pool, Admission(itl_s=0.05), RouterMetrics().refused, MeanAnswer(), clock)
    tick = gate.clock(W)
    for _ in range(6):  # each step sends one token of every sample, one delta each
        for sample in range(n):
            tick(sample, 1)
        clock.now_s += STEP_S
    mean_s = gate.gaps[W].mean_s(clock.now_s)
    assert mean_s == pytest.approx(STEP_S, rel=0.05)
    # Its streams are slower than the target: more work there is refused.
    pool.state(W).num_inflight = 1
    with pytest.raises(Exhausted, match="inter-token target"):
        gate.check(0.0, 0.0, [(W, 0.0)], RequestOutcome("r", "round_robin"))
