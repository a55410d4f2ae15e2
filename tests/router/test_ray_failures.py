"""Every Ray error a call can raise is a worker failure of a known kind (never a client error
turned INTERNAL): the table below is what the pool acts on."""

from __future__ import annotations

import asyncio

import pytest
import ray.exceptions as rex

from router.ray_failures import Failure, classify, ray_error_types

CASES = [
    (rex.ActorDiedError(), Failure.GONE),
    (rex.RayActorError(), Failure.GONE),
    (rex.ActorUnavailableError("restarting", None), Failure.UNAVAILABLE),
    (rex.OutOfMemoryError("killed by the memory monitor"), Failure.UNAVAILABLE),
    (rex.WorkerCrashedError(), Failure.UNAVAILABLE),
    (rex.NodeDiedError("node gone"), Failure.UNAVAILABLE),
    (rex.RaySystemError("gcs"), Failure.UNAVAILABLE),
    (rex.GetTimeoutError("slow"), Failure.TIMEOUT),
    (asyncio.TimeoutError(), Failure.TIMEOUT),
    (rex.RayTaskError("generate", "traceback", ValueError("engine step failed")), Failure.TASK),
]


@pytest.mark.parametrize(("exc", "failure"), CASES, ids=[type(c[0]).__name__ for c in CASES])
def test_each_ray_error_is_a_worker_failure_of_its_kind(
    exc: BaseException, failure: Failure
) -> None:
    assert isinstance(exc, ray_error_types())
    assert classify(exc) is failure


def test_a_client_side_bug_is_not_taken_for_a_worker_failure() -> None:
    assert not isinstance(ValueError("bad"), ray_error_types())
