"""What a call to a worker can end in, as the router's code sees it: the worker failed
(`WorkerDied`), or it refused the request (`raise_stream_error`: the router's typed error)."""

from __future__ import annotations

from typing import NoReturn

from cachesvc.kv.types import WorkerId
from router.domain import Exhausted, InvalidInput, RequestFailed, Unimplemented
from workers.protocol import StreamError


class WorkerDied(Exception):
    """The worker failed during a call (died, restarting, unreachable or frozen)."""

    def __init__(self, worker: WorkerId, started: bool) -> None:
        super().__init__(f"worker {worker} died")
        self.worker = worker
        self.started = started  # True once the worker sent back part of the answer


_ERRORS = {
    "invalid_argument": InvalidInput,
    "resource_exhausted": Exhausted,
    "internal": RequestFailed,
}


def raise_stream_error(error: StreamError) -> NoReturn:
    """Turn a worker's refusal into the router's typed error."""
    raise _ERRORS.get(error.code, Unimplemented)(error.message)
