"""CircuitBreaker on a fake clock: it opens after N failures in a row, skips calls while open,
lets exactly one probe through after the cool-down, and closes or reopens on its outcome."""

from __future__ import annotations

import pytest

from cachesvc.kv.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# Each step: an action ("ok", "fail", "allow", "tick") and the state after it; "allow" also
# checks its answer.
@pytest.mark.parametrize(
    ("steps", "opens"),
    [
        # Failures must be in a row: a success in between starts the count again.
        ([("fail", CLOSED), ("fail", CLOSED), ("ok", CLOSED), ("fail", CLOSED)], 0),
        ([("fail", CLOSED), ("fail", CLOSED), ("fail", OPEN), ("allow", False)], 1),
        # After the cool-down one probe goes through; a second caller is still skipped.
        (
            [("fail", CLOSED), ("fail", CLOSED), ("fail", OPEN), ("tick", HALF_OPEN)]
            + [("allow", True), ("allow", False), ("ok", CLOSED), ("allow", True)],
            1,
        ),
        # A failed probe opens it again for a whole cool-down.
        (
            [("fail", CLOSED), ("fail", CLOSED), ("fail", OPEN), ("tick", HALF_OPEN)]
            + [("allow", True), ("fail", OPEN), ("allow", False), ("tick", HALF_OPEN)],
            2,
        ),
        # A late failure of a call that started before it opened does not count as an opening.
        ([("fail", CLOSED), ("fail", CLOSED), ("fail", OPEN), ("fail", OPEN)], 1),
    ],
)
def test_transitions(steps: list[tuple[str, object]], opens: int) -> None:
    clock = Clock()
    breaker = CircuitBreaker(max_failures=3, cooldown_s=5.0, clock=clock)
    for action, want in steps:
        if action == "ok":
            breaker.succeeded()
        elif action == "fail":
            breaker.failed()
        elif action == "tick":
            clock.now += 5.0
        else:
            assert breaker.allow() is want
            continue
        assert breaker.state == want, (action, steps)
    assert breaker.num_opens == opens


def test_failed_says_when_it_opened() -> None:
    breaker = CircuitBreaker(max_failures=1, cooldown_s=0.0)
    assert breaker.failed() is True
    assert breaker.allow() is True  # no cool-down: the next call is the probe at once
    assert breaker.allow() is False
    assert breaker.failed() is True and breaker.num_opens == 2


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(max_failures=0, cooldown_s=1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(max_failures=1, cooldown_s=-1.0)
