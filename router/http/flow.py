"""A request's life on the HTTP door, shared by its endpoints: awaiting work while watching for
the client to go away, and the error answer of whatever ended a request."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from router.domain import RouterError
from router.http.body import ClientGone
from router.http.errors import HttpError, from_router_error

T = TypeVar("T")
_log = logging.getLogger("router.http.app")  # the door's one logger, whichever endpoint


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """`work`'s result; cancels it and raises ClientGone when the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def http_error(exc: Exception, request_id: str | None) -> HttpError:
    """The error answer of `exc`; one that is neither the client's nor the router's own
    (a bug) is logged with its traceback, as the gRPC door logs it."""
    if isinstance(exc, ClientGone):
        return HttpError(499, "client closed the request")
    if not isinstance(exc, HttpError | RouterError):
        _log.exception("internal error", exc_info=exc, extra={"request_id": request_id})
    return from_router_error(exc)
