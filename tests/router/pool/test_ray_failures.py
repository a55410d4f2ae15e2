"""Every Ray error a call can raise is a worker failure of a known kind (never a client error
turned INTERNAL): the table below is what the pool acts on. Calls to Ray's control store run
off the loop (`off_loop`) and never hold up its end."""

from __future__ import annotations

import asyncio
import threading

import pytest
import ray.exceptions as rex

from router.pool.ray_failures import Failure, classify, off_loop, ray_error_types

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


def test_off_loop_returns_and_raises_what_the_call_did() -> None:
    async def main() -> tuple[int, str]:
        value = await off_loop(lambda a, b: a + b, 2, 3)
        try:
            await off_loop(int, "not a number")
        except ValueError as exc:
            return value, str(exc)
        return value, ""

    value, error = asyncio.run(main())
    assert value == 5 and "not a number" in error


def test_a_control_store_call_still_blocked_does_not_hold_up_the_loops_end() -> None:
    # A call to an unreachable control store blocks its thread; the event loop still ends (its
    # task cancelled at asyncio.run's end), and so does the process, where asyncio.to_thread's
    # executor would be joined and wait for the call.
    release = threading.Event()

    async def main() -> None:
        asyncio.get_running_loop().create_task(off_loop(release.wait))
        await asyncio.sleep(0.05)  # the call is under way when the loop ends

    runner = threading.Thread(target=asyncio.run, args=(main(),))
    runner.start()
    runner.join(timeout=60)
    ended = not runner.is_alive()
    release.set()
    assert ended
