"""A worker's "internal" refusal (the engine failed while serving that request alone) is the
router's RequestFailed: INTERNAL on gRPC, 500 on HTTP, with the worker's message; never the
UNIMPLEMENTED of an unknown code, never a failover."""

from __future__ import annotations

import grpc
import pytest

from router.domain import RequestFailed
from router.grpc.calls import status_of as _status_of
from router.http.errors import from_router_error
from router.pool.worker_errors import raise_stream_error
from workers.protocol import StreamError

MESSAGE = "the request failed on worker worker-0: ZeroDivisionError: float division by zero"


def test_internal_refusal_is_request_failed_on_both_doors() -> None:
    with pytest.raises(RequestFailed, match="ZeroDivisionError") as info:
        raise_stream_error(StreamError("internal", MESSAGE))
    assert _status_of(info.value) is grpc.StatusCode.INTERNAL
    http = from_router_error(info.value)
    assert (http.status, http.message, http.type) == (500, MESSAGE, "server_error")
