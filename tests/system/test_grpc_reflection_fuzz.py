"""A client that knows the router only through server reflection, as outside checkers do: it
builds every service's descriptors from the reflection service and sends messages built from
them with random field values, and bodies that are not messages at all (random bytes, invalid
UTF-8 in a string field, groups nested past any parser's depth, more than the size limit).
Every answer parses as the reflected response type or is a refusal whose details name the field
(or the message type); the workers stay healthy and keep their tokens."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message import Message
from grpc_fuzz_support import (
    MAX_MESSAGE_BYTES,
    Beside,
    Reference,
    check_refusal,
    check_still_serving,
    normal_beside,
)
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from proto_strategies import messages_of

pytestmark = pytest.mark.system
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_STREAMED = 64  # messages read from a stream before hanging up: bounded run time
F = FieldDescriptor


@dataclass(frozen=True)
class Method:
    path: str
    request: Descriptor
    response: Descriptor
    streaming: bool


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(max_queued_per_worker=64)


@pytest.fixture(scope="module")
def reference(server: Any) -> Reference:
    return Reference.of(server)


@pytest.fixture(scope="module")
def beside(server: Any, reference: Reference) -> Iterator[Beside]:
    with normal_beside(server) as streams:
        yield streams


@pytest.fixture(scope="module")
def methods(server: Any) -> list[Method]:
    """Every method of the router's own services, from reflection alone."""
    database = ProtoReflectionDescriptorDatabase(server.channel())
    pool = DescriptorPool(database)
    found = []
    for name in database.get_services():
        if not name.startswith("cachesvc."):
            continue  # health and reflection: grpc's own
        service = pool.FindServiceByName(name)
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            found.append(Method(path, m.input_type, m.output_type, m.server_streaming))
    names = {m.path.rsplit("/", 1)[1] for m in found}
    assert {"Generate", "Score", "Tokenize", "ListWorkers", "Stats", "Flush", "Purge"} <= names
    return found


def _call(server: Any, method: Method, body: bytes) -> list[Message] | grpc.RpcError:
    """The answers to `body` (sent as it is), each parsed as the reflected response type; or
    the call's error."""
    channel = server.channel()
    parse = message_factory.GetMessageClass(method.response).FromString
    try:
        if not method.streaming:
            return [parse(channel.unary_unary(method.path)(body, timeout=120))]
        call = channel.unary_stream(method.path)(body, timeout=120)
        answers = []
        for raw in call:
            answers.append(parse(raw))
            if len(answers) == MAX_STREAMED:
                call.cancel()
                break
        return answers
    except grpc.RpcError as err:
        return err


def _check(server: Any, method: Method, body: bytes) -> None:
    outcome = _call(server, method, body)
    if isinstance(outcome, grpc.RpcError):
        event(f"{method.path}: {outcome.code().name}")
        check_refusal(outcome, method.request, len(body))
    else:
        event(f"{method.path}: answered")
        assert outcome, "a call answered with no message"


@FUZZ
@given(data=st.data())
def test_reflected_messages_get_an_answer_or_a_named_refusal(
    server: Any, beside: Beside, methods: list[Method], data: st.DataObject
) -> None:
    method = data.draw(st.sampled_from(methods), label="method")
    message = data.draw(messages_of(method.request), label="message")
    _check(server, method, message.SerializeToString())


def _nested_groups(depth: int) -> bytes:
    return b"\x0b" * depth + b"\x0c" * depth  # start-group / end-group of field 1


BODIES = st.one_of(
    st.binary(max_size=256),
    st.builds(_nested_groups, st.integers(90, 200_000)),
    st.builds(lambda n: b"\x0a" + bytes([n]) + b"\xff" * (n // 2), st.integers(1, 127)),
)


@FUZZ
@given(data=st.data(), body=BODIES)
def test_bodies_that_are_no_message_get_a_named_refusal(
    server: Any, beside: Beside, methods: list[Method], data: st.DataObject, body: bytes
) -> None:
    """Random bytes, truncated fields, groups nested past the parser's depth limit."""
    _check(server, data.draw(st.sampled_from(methods), label="method"), body)


def _string_paths(descriptor: Descriptor, depth: int = 0) -> Iterator[list[FieldDescriptor]]:
    """Each string field reachable from `descriptor`, as the chain of fields to it."""
    for f in descriptor.fields:
        if f.type == F.TYPE_STRING:
            yield [f]
        elif f.type == F.TYPE_MESSAGE and depth < 4 and not f.message_type.GetOptions().map_entry:
            yield from ([f, *rest] for rest in _string_paths(f.message_type, depth + 1))


PLACEHOLDER = "\x01" * 12


def _with_bad_utf8(descriptor: Descriptor, chain: list[FieldDescriptor]) -> tuple[bytes, str]:
    """A body with only the string at the end of `chain` set, to invalid UTF-8; and the
    field's path as the router's messages write it (`prompt.chat.messages[0].content`)."""
    msg = message_factory.GetMessageClass(descriptor)()
    node, names = msg, []
    for f in chain[:-1]:
        repeated = f.is_repeated
        node = getattr(node, f.name).add() if repeated else getattr(node, f.name)
        names.append(f"{f.name}[0]" if repeated else f.name)
    last = chain[-1]
    if last.is_repeated:
        getattr(node, last.name).append(PLACEHOLDER)
        names.append(f"{last.name}[0]")
    else:
        setattr(node, last.name, PLACEHOLDER)
        names.append(last.name)
    body = msg.SerializeToString()
    assert body.count(PLACEHOLDER.encode()) == 1
    return body.replace(PLACEHOLDER.encode(), b"\xff\xfe" * 6), ".".join(names)


def test_invalid_utf8_in_any_string_field_is_refused_naming_the_field(
    server: Any, beside: Beside, methods: list[Method]
) -> None:
    checked = []
    for method in methods:
        for chain in _string_paths(method.request):
            body, path = _with_bad_utf8(method.request, chain)
            outcome = _call(server, method, body)
            assert isinstance(outcome, grpc.RpcError), (method.path, path, "accepted")
            assert outcome.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, outcome.code())
            assert path in (outcome.details() or ""), (method.path, path, outcome.details())
            checked.append(path)
    assert "prompt.chat.messages[0].content" in checked and "items[0].text" in checked


def test_a_body_over_the_size_limit_is_refused(server: Any, methods: list[Method]) -> None:
    [tokenize] = [m for m in methods if m.path.endswith("/Tokenize")]
    prompt = tokenize.request.fields_by_name["prompt"]
    text_field = prompt.message_type.fields_by_name["text"]
    # The prompt's text, 5 MiB of it, encoded by hand.
    text = b"a" * (MAX_MESSAGE_BYTES + 2**20)
    inner = _tag(text_field.number) + _varint(len(text)) + text
    body = _tag(prompt.number) + _varint(len(inner)) + inner
    outcome = _call(server, tokenize, body)
    assert isinstance(outcome, grpc.RpcError)
    assert outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, outcome.code()


def _tag(number: int) -> bytes:
    return _varint(number << 3 | 2)  # wire type 2: length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_streams_beside_the_fuzzing_kept_their_tokens(beside: Beside, reference: Reference) -> None:
    beside.check(reference)


def test_still_serving_the_same_tokens_on_the_same_workers(
    server: Any, reference: Reference
) -> None:
    check_still_serving(server, reference)
