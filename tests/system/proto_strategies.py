"""Hypothesis strategies of any protobuf message from its descriptor alone, as a client that
knows a server only through reflection builds them: every field set or left unset, at most one
field of a oneof, hostile values of each field's type (and, now and then, small ones a server
accepts), repeated fields short or huge."""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from grpc_fuzz_support import FLOATS, INT32, INT64, TEXT, TOKEN, UINT32, UINT64, WILD_TEXT
from hypothesis import strategies as st

F = FieldDescriptor
_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    F.TYPE_DOUBLE: FLOATS,
    F.TYPE_FLOAT: FLOATS,
    F.TYPE_INT32: INT32 | st.integers(0, 8),
    F.TYPE_SINT32: INT32,
    F.TYPE_SFIXED32: INT32,
    F.TYPE_INT64: INT64 | TOKEN,
    F.TYPE_SINT64: INT64,
    F.TYPE_SFIXED64: INT64,
    F.TYPE_UINT32: UINT32,
    F.TYPE_FIXED32: UINT32,
    F.TYPE_UINT64: UINT64,
    F.TYPE_FIXED64: UINT64,
    F.TYPE_BOOL: st.booleans(),
    F.TYPE_STRING: WILD_TEXT,
    # Invalid UTF-8 among them: bytes fields take any.
    F.TYPE_BYTES: st.binary(max_size=64) | st.just(b"\xff\xfe\x00\xc0\x80"),
    F.TYPE_ENUM: INT32,  # proto3 enums are open: any int32 is a value
}
MAX_DEPTH = 4


def messages_of(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type (its class from the default message factory)."""
    cls = message_factory.GetMessageClass(descriptor)
    # An `optional` field sits in a oneof of its own: set or not, as with any oneof.
    oneofs = list(descriptor.oneofs)
    in_oneof = {f.name for o in oneofs for f in o.fields}

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        chosen = [draw(st.none() | st.sampled_from(list(o.fields))) for o in oneofs]
        for f in descriptor.fields:
            wanted = f in chosen if f.name in in_oneof else draw(st.booleans())
            if wanted and (f.type != F.TYPE_MESSAGE or depth < MAX_DEPTH):
                _set(msg, f, draw(_values(f, depth)))
        return msg

    return build()


def _values(f: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    one = messages_of(f.message_type, depth + 1) if f.type == F.TYPE_MESSAGE else _SCALARS[f.type]
    if not _repeated(f):
        return one
    if f.type == F.TYPE_MESSAGE:
        return st.lists(one, max_size=4)
    # Huge lists repeat one short value: a huge string repeated would not fit in memory.
    short = TEXT if f.type == F.TYPE_STRING else one
    huge = st.builds(lambda v, k: [v] * k, short, st.integers(1_000, 200_000))
    return st.lists(one, max_size=6) | huge


def _repeated(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated)


def _set(msg: Message, f: FieldDescriptor, value: Any) -> None:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        return  # maps are answers' fields only; a request with one would need keys drawn
    target = getattr(msg, f.name)
    if _repeated(f) and f.type == F.TYPE_MESSAGE:
        for item in value:
            target.add().CopyFrom(item)
    elif _repeated(f):
        target.extend(value)
    elif f.type == F.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(msg, f.name, value)
