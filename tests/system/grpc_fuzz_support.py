"""What the gRPC door's property tests share: Hypothesis strategies of hostile values (extreme
numbers, awkward unicode, huge strings), the rule every answer must obey, and streams run beside
the fuzzing whose tokens must not change."""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc

VOCAB = 320  # the tiny model of tests/system/conftest.py
# The size of message a gRPC server takes by default; a request over it is grpc's own refusal.
MAX_MESSAGE_BYTES = 4 * 2**20
NAN, INF = float("nan"), float("inf")

# Codes of a well-formed refusal: the client's fault or the server's load, never a crash.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}
# Refusals that are about the request's content: their details must say which field.
_NAMING = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
}

# Characters that break naive handling: NUL, bidi controls (RLO, RLM, LRI), BOM, a noncharacter,
# non-BMP code points, the model's special tokens, line breaks, template syntax.
NASTY = [
    "\x00",
    "\u202e",
    "\u200f",
    "\u2066",
    "\ufeff",
    "\uffff",
    "\U0001f600",
    "\U00010000",
    "\U0010ffff",
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "\r\n",
    "{{ messages }}",
    "{% endfor %}",
]
INT32_EDGES = [-(2**31), -1, 0, 1, 2**31 - 1]
INT64_EDGES = [-(2**63), -(2**31) - 1, -1, 0, VOCAB, 2**31, 2**63 - 1]
FLOAT_EDGES = [1e308, -1e308, 1e-300, -1e-300, 5e-324, 1.4e-45, 3.4028235e38, -0.0, NAN, INF, -INF]

INT32 = st.sampled_from(INT32_EDGES) | st.integers(-(2**31), 2**31 - 1)
INT64 = st.sampled_from(INT64_EDGES) | st.integers(-(2**63), 2**63 - 1)
UINT32 = st.sampled_from([0, 1, 2**32 - 1]) | st.integers(0, 2**32 - 1)
UINT64 = st.sampled_from([0, 1, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1)
FLOATS = st.sampled_from(FLOAT_EDGES) | st.floats()
TOKEN = st.integers(0, VOCAB - 1)
NASTY_TEXT = st.lists(st.sampled_from(NASTY), min_size=1, max_size=8).map("".join)
# Up to about 2 MB: large, yet under the request size limit (the test of that limit is apart).
HUGE_TEXT = st.builds(lambda s, k: s * k, st.sampled_from(["a", *NASTY]), st.integers(300, 150_000))
TEXT = st.text(st.characters(codec="utf-8"), max_size=40) | NASTY_TEXT
# A request id a server takes: printable (router.request.ids refuses control characters).
ID_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cc"]), max_size=40)
WILD_TEXT = TEXT | HUGE_TEXT


def field_names(descriptor: Descriptor) -> frozenset[str]:
    """Every field name in `descriptor`'s tree of messages, and the message's own name."""
    names = {descriptor.full_name}
    seen: set[str] = set()
    todo = [descriptor]
    while todo:
        message = todo.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        for f in message.fields:
            names.add(f.name)
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                todo.append(f.message_type)
    return frozenset(names)


def check_refusal(err: grpc.RpcError, descriptor: Descriptor, request_bytes: int) -> None:
    """A failed call must be a refusal: a client error whose details name a field of the
    request (or its message type, for a body that does not parse), or the server's load. Never
    INTERNAL / UNKNOWN / UNAVAILABLE, a dropped connection or a missed deadline."""
    code, details = err.code(), err.details() or ""
    assert code in REFUSALS, (code, details)
    if code in _NAMING:
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_.]*", details))
        words |= {part for w in words for part in w.split(".")}
        assert words & field_names(descriptor), ("the details name no field", code, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and request_bytes < MAX_MESSAGE_BYTES:
        # grpc's own size check on a request under its limit: the answer was too large for the
        # client to take, so all the work was done for nothing.
        assert "larger than max" not in details, details


def normal_request(max_tokens: int, **sampling: Any) -> pb.GenerateRequest:
    """A plain text request that runs for `max_tokens` tokens."""
    params = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return pb.GenerateRequest(
        prompt=pb.Prompt(text="The quick brown fox jumps over the lazy dog."),
        sampling=params,
        no_response_cache=True,
    )


# Long enough to stay on a worker while a good part of the fuzzing runs; greedy, and sampled
# with a seed (its draws depend on nothing else in the batch).
NORMAL = {
    "greedy": normal_request(300, temperature=0.0),
    "seeded": normal_request(300, temperature=0.8, top_k=40, top_p=0.9, seed=7),
}


def tokens_of(channel: grpc.Channel, request: pb.GenerateRequest) -> list[int]:
    stub = pb_grpc.InferenceStub(channel)
    return [t for m in stub.Generate(request, timeout=300) for t in m.token_ids]


@dataclass(frozen=True)
class Reference:
    """Before any fuzzing: the normal requests' tokens, and each worker's incarnation."""

    tokens: dict[str, list[int]]
    incarnations: dict[str, str]

    @classmethod
    def of(cls, server: Any) -> Reference:
        tokens = {name: tokens_of(server.channel(), r) for name, r in NORMAL.items()}
        return cls(tokens, {s.worker_id: s.incarnation for s in server.router.pool.states()})


def check_still_serving(server: Any, reference: Reference) -> None:
    """After the fuzzing: the same greedy tokens from the same workers (none restarted, none
    unhealthy, no request retried elsewhere), and no call answered INTERNAL or UNKNOWN."""
    assert tokens_of(server.channel(), NORMAL["greedy"]) == reference.tokens["greedy"]
    router = server.router
    assert {s.worker_id: s.incarnation for s in router.pool.states()} == reference.incarnations
    assert router.stats().num_retries == 0, "a request was retried: a worker failed it"
    workers = pb_grpc.AdminStub(server.channel()).ListWorkers(pb.ListWorkersRequest()).workers
    assert {w.health for w in workers} == {pb.WorkerInfo.HEALTHY}
    for method in ("Generate", "Tokenize", "Score"):
        for code in ("INTERNAL", "UNKNOWN", "UNAVAILABLE"):
            count = router.metrics.requests.labels("grpc", method, code)._value.get()
            assert count == 0, (method, code)


@dataclass(repr=False)
class Beside:
    """Runs `requests` over and over on a thread of its own until `stop`; every run's tokens
    are kept, per request (an RpcError is kept in `errors`)."""

    channel: grpc.Channel
    requests: dict[str, pb.GenerateRequest]
    runs: dict[str, list[list[int]]] = field(default_factory=dict)
    errors: list[BaseException] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _started: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        """Start, and return once the first stream has sent its first tokens (so it is live
        on a worker when the fuzzing starts)."""
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        assert self._started.wait(120), "the stream beside the fuzzing never started"

    def stop(self) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(600)
        assert not self._thread.is_alive()

    def check(self, reference: Reference) -> None:
        """Stop, then: every run of every request gave the reference's tokens."""
        self.stop()
        assert not self.errors, self.errors
        for name, runs in self.runs.items():
            assert all(run == reference.tokens[name] for run in runs), name
        assert set(self.runs) == set(self.requests), "a stream beside the fuzzing never finished"

    def _loop(self) -> None:
        stub = pb_grpc.InferenceStub(self.channel)
        try:
            while not self._stop.is_set():
                for name, request in self.requests.items():
                    tokens: list[int] = []
                    for message in stub.Generate(request, timeout=300):
                        tokens.extend(message.token_ids)
                        self._started.set()
                    self.runs.setdefault(name, []).append(tokens)
        except BaseException as exc:  # reported by the test that stops it
            self.errors.append(exc)
            self._started.set()


@contextlib.contextmanager
def normal_beside(server: Any) -> Iterator[Beside]:
    """The normal requests, run again and again while a module's fuzzing goes on (`Beside`),
    live on a worker before it starts; stopped at the end (idempotent: a module's last check
    stops them first)."""
    streams = Beside(server.channel(), NORMAL)
    streams.start()
    yield streams
    streams.stop()
