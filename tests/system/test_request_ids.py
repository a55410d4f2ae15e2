"""Request ids are the client's labels, not handles: one tenant's call can neither abort nor
probe another's request, whatever id it sends."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.tenants import TenantToken

pytestmark = pytest.mark.system
TENANTS = (TenantToken("acme", "acme-tok"), TenantToken("umbrella", "umbrella-tok"))


def _request(max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id="shared-id",
        prompt=pb.Prompt(text="Routing sends each request to the worker that holds its prefix."),
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


def test_another_tenants_cancel_with_the_same_id_does_not_end_my_stream(
    make_server: Any,
) -> None:
    server = make_server(tenant_tokens=TENANTS)
    stub = pb_grpc.InferenceStub(server.channel())
    acme = [("authorization", "Bearer acme-tok")]
    umbrella = [("authorization", "Bearer umbrella-tok")]
    max_tokens = 300
    started = threading.Event()
    messages: list[pb.GenerateResponse] = []

    def acme_stream() -> None:
        for message in stub.Generate(_request(max_tokens), metadata=acme, timeout=120):
            messages.append(message)
            started.set()

    thread = threading.Thread(target=acme_stream)
    thread.start()
    assert started.wait(60), "acme's stream never started"
    # The other tenant cancels a call that carries the same id, many times over.
    for _ in range(5):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(_request(max_tokens), metadata=umbrella, timeout=0.01))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # And a complete call with that id is served, not refused as a clash.
    theirs = list(stub.Generate(_request(2), metadata=umbrella, timeout=60))
    assert theirs[-1].finish_reason == "length"
    thread.join(120)
    assert not thread.is_alive()
    assert messages[-1].finish_reason == "length", messages[-1]
    assert sum(len(m.token_ids) for m in messages) == max_tokens
    assert {m.request_id for m in messages} == {"shared-id"}  # the client's id, echoed
