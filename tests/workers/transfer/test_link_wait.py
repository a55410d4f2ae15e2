"""How a puller's wait for a peer's answer ends (`workers.transfer.ray_link`): with the answer,
at the deadline, or, for a pull that may be stopped, soon after it is stopped."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from workers.transfer.ray_link import _result


def test_an_answer_is_returned() -> None:
    answer: Future[Any] = Future()
    answer.set_result("chunk")
    assert _result(answer, time.monotonic() + 5, None) == "chunk"
    assert _result(answer, time.monotonic() + 5, threading.Event()) == "chunk"


def test_no_answer_by_the_deadline_raises() -> None:
    with pytest.raises(TimeoutError):
        _result(Future(), time.monotonic() + 0.05, None)
    with pytest.raises(TimeoutError):
        _result(Future(), time.monotonic() + 0.05, threading.Event())


def test_a_stopped_pull_stops_waiting_long_before_its_deadline() -> None:
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    waited: list[BaseException] = []

    def wait() -> None:
        try:
            _result(Future(), time.monotonic() + 600, stop)
        except TimeoutError as exc:
            waited.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join(timeout=60)  # a bound on a hang, not a timing: the deadline is 600 s
    assert not waiter.is_alive() and waited
