"""The calibration's engine is timed at the live workers' priority: on a thread of its own,
niced as Ray nices its workers, leaving the caller's own priority alone."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from cachesvc.sim.engine_timing import WORKER_NICENESS, at_worker_priority


def _own_niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness: Linux")
def test_timing_runs_at_the_workers_niceness_and_leaves_the_caller_alone() -> None:
    before = _own_niceness()
    seen = at_worker_priority(lambda: (_own_niceness(), threading.get_native_id()))
    assert seen[0] == max(before, WORKER_NICENESS), "the timed thread yields as a worker does"
    assert seen[1] != threading.get_native_id(), "on a thread of its own"
    assert _own_niceness() == before, "the caller's priority is not lowered for good"


def test_what_the_timed_call_raises_reaches_the_caller() -> None:
    def fails() -> None:
        raise KeyError("step")

    with pytest.raises(KeyError, match="step"):
        at_worker_priority(fails)
    assert at_worker_priority(lambda: 7) == 7
