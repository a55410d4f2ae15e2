"""Plans are timed from admission to the end of the prompt, summed per kind, and a preempted
or released request's plan is not counted."""

from __future__ import annotations

import logging
import time

import pytest

from cachesvc.kv.planner import FetchRange, LoadPlan
from cachesvc.kv.types import RequestId
from workers.engine.request import Request
from workers.engine.tiering.plan_timing import PlanTimer
from workers.sampling_params import SamplingParams


def _plan(kind: str, predicted_s: float = 0.25) -> LoadPlan:
    fetch = (FetchRange("dram", 0, 3),) if kind != "recompute" else ()
    end = 3 if fetch else 0
    return LoadPlan(kind, 0, 0, end, fetch, predicted_s, 1.0, 2.0, 1.5)  # type: ignore[arg-type]


def _request(name: str, prompt_len: int = 16) -> Request:
    return Request(RequestId(name), list(range(prompt_len)), SamplingParams(max_tokens=2))


def test_a_plan_is_timed_to_the_end_of_its_prompt(caplog: pytest.LogCaptureFixture) -> None:
    timer = PlanTimer()
    request = _request("a")
    timer.start(request, _plan("fetch"))
    request.num_computed_tokens = 8
    timer.on_computed(request)
    assert timer.metrics() == {}  # half the prompt: still open
    time.sleep(0.01)
    request.num_computed_tokens = 16
    with caplog.at_level(logging.INFO, logger="workers.engine.tiering.plan_timing"):
        timer.on_computed(request)
    metrics = timer.metrics()
    assert metrics["plan_fetch_timed"] == 1 and metrics["plan_fetch_predicted_s"] == 0.25
    assert metrics["plan_fetch_actual_s"] >= 0.01
    assert "plan fetch (fetch 3 blocks from dram, recompute 0), predicted 250.0 ms" in caplog.text
    timer.on_computed(request)  # later steps of the same request change nothing
    assert timer.metrics() == metrics


def test_preempted_released_and_unplanned_requests_are_not_counted() -> None:
    timer = PlanTimer()
    preempted, released, unplanned = _request("p"), _request("r"), _request("u")
    timer.start(preempted, _plan("split"))
    timer.start(released, _plan("recompute"))
    timer.start(unplanned, _plan("none"))
    preempted.num_preemptions = 1
    timer.drop(released.request_id)
    for request in (preempted, released, unplanned):
        request.num_computed_tokens = request.num_prompt_tokens
        timer.on_computed(request)
    assert timer.metrics() == {}
