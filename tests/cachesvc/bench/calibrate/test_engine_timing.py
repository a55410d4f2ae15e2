"""The calibration's engine is timed at the live workers' priority: on a thread of its own,
niced as Ray nices its workers, leaving the caller's own priority alone."""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace

import pytest

from cachesvc.bench.calibrate.engine_timing import (
    WORKER_NICENESS,
    at_worker_priority,
    measure_prefill,
)


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


class _RecordingEngine:
    """Takes `measure_prefill`'s requests and records their prompts (no model: what is checked
    is which tokens it asks for, not how long they take)."""

    def __init__(self) -> None:
        self.loaded = SimpleNamespace(config=SimpleNamespace(vocab_size=1000))
        self.prompts: list[list[int]] = []
        self._pending = 0

    def add_request(self, prompt: list[int], _params: object) -> None:
        self.prompts.append(list(prompt))
        self._pending += 1

    def generate(self, prompts: list[list[int]], _params: object) -> None:
        self.prompts += [list(p) for p in prompts]

    def step(self) -> None:
        self._pending = 0

    def has_unfinished(self) -> bool:
        return self._pending > 0


def test_a_longer_prompt_timed_after_a_shorter_one_shares_no_cached_prefix_with_it() -> None:
    # The live calibration times 64 then 128 new tokens with one seed per round: were the
    # 128's first 64 the 64's, a prefix cache would hit them and the step computed would be
    # half the one named, and the live worker's prefill would look 100+ ms slower than it is.
    engine = _RecordingEngine()
    for n in (16, 64, 128):
        measure_prefill(engine, [(n, 0)], seed=1)  # type: ignore[arg-type]
    firsts = [tuple(p[:16]) for p in engine.prompts]
    assert len(set(firsts)) == len(firsts), "every timed prompt starts with a block of its own"
    before = len(engine.prompts)
    measure_prefill(engine, [(64, 0)], seed=1)  # type: ignore[arg-type]
    assert engine.prompts[before:] == engine.prompts[3:6], "the same shape and seed: the same"
