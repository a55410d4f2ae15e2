"""What a Ray error says about a worker, and what Ray's control store knows of an actor.

Every Ray error a call can raise is a worker failure, never a client's error: the request
fails over (or the client gets UNAVAILABLE), and the worker's health changes by `Failure`:

- GONE: the actor process died (`RayActorError` that is not "unavailable"); whether it comes
  back (restarts left) or not is asked of Ray's control store (`actor_state`);
- UNAVAILABLE: it may answer later (restarting, unreachable, its process killed by Ray's memory
  monitor, a crashed task worker, a lost object, a dead node, a system error);
- TIMEOUT: it did not answer in time (frozen, or a very long step);
- TASK: the actor is fine but the call raised (a failed model run ended every request of
  its step): the request fails over, the worker's health does not change.

A failure of one request alone (the engine raised while handling it, not the batch) is no Ray
error: the worker answers it as a `StreamError` "internal", which the router passes to the
client (`router.domain.RequestFailed`) without failing over: another worker would fail alike.

Ray is imported inside the functions only.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Failure(str, enum.Enum):
    GONE = "gone"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    TASK = "task"


def ray_error_types() -> tuple[type[BaseException], ...]:
    """The exceptions a call to a worker (with a timeout) can raise that mean it failed."""
    from ray.exceptions import RayError

    return (RayError, TimeoutError, asyncio.TimeoutError)


def classify(exc: BaseException) -> Failure:
    """The kind of failure a Ray call's exception is (any exception of `ray_error_types`)."""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

    if isinstance(exc, (TimeoutError, asyncio.TimeoutError, GetTimeoutError)):
        return Failure.TIMEOUT
    if isinstance(exc, RayTaskError):
        return Failure.TASK
    if isinstance(exc, RayActorError) and not isinstance(exc, ActorUnavailableError):
        return Failure.GONE
    return Failure.UNAVAILABLE


def actor_state(actor: Any) -> str | None:
    """The actor's state in Ray's control store ("ALIVE", "RESTARTING", "DEAD", ...), None
    when it cannot be read. Blocks on a call to the control store: run it in a thread."""
    try:
        from ray._private.state import state

        entry = state.actor_table(actor._actor_id.hex())
        return str(entry["State"]) if entry else None
    except Exception:  # a private API: an unknown state only delays the verdict
        return None


def kill(actor: Any) -> None:
    """Kill an actor for good (no restart); an actor already gone is fine."""
    import ray

    with contextlib.suppress(Exception):  # already dead, or its handle is stale
        ray.kill(actor, no_restart=True)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a daemon thread of its own, awaited: for calls to Ray's control store,
    which can block for as long as the cluster is unreachable. Unlike `asyncio.to_thread`, a
    call still blocked when the event loop ends holds up neither `asyncio.run`'s exit (it joins
    the default executor's threads) nor the interpreter's."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, exc: BaseException | None) -> None:
        if future.done():  # the awaiting task was cancelled meanwhile
            return
        if exc is None:
            future.set_result(result)  # type: ignore[arg-type]
        else:
            future.set_exception(exc)

    def run() -> None:
        try:
            result, exc = fn(*args), None
        except BaseException as error:  # handed to the awaiting task
            result, exc = None, error
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=run, name="ray-control", daemon=True).start()
    return await future
