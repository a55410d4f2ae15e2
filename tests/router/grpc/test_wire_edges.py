"""The wire's edges: a Score whose answer could not be sent is refused before any work, a body
that does not parse is refused naming the field of invalid UTF-8, request ids follow the rule
both doors share, and a max_tokens the client set is marked so (past the context it is refused,
not lowered)."""

from __future__ import annotations

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.config import RouterConfig
from router.domain import InvalidInput
from router.grpc.wire import generate_from_proto, score_from_proto, undecodable_reason

CLIENT_LIMIT = 4 * 2**20  # the largest message a gRPC client takes by default
MARK = "\x01" * 8
CONFIG = RouterConfig()


def _score(num_items: int, num_labels: int) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        prefix=pb.Prompt(text="hello"),
        items=[pb.Prompt(token_ids=pb.TokenIds(ids=[5]))] * num_items,
        label_token_ids=[3] * num_labels,
    )


def _answer_bytes(num_items: int, num_labels: int) -> int:
    row = pb.ItemScores(logprobs=[-1.0] * num_labels)
    return pb.ScoreResponse(scores=[row] * num_items, worker_id="worker-10").ByteSize()


@pytest.mark.parametrize(("num_items", "num_labels"), [(4, 300_000), (1, 1_100_000), (2**19, 1)])
def test_a_score_whose_answer_is_too_large_to_send_is_refused(
    num_items: int, num_labels: int
) -> None:
    assert _answer_bytes(num_items, num_labels) > CLIENT_LIMIT
    with pytest.raises(InvalidInput, match=r"items x label_token_ids: .* send fewer"):
        score_from_proto(_score(num_items, num_labels))


@pytest.mark.parametrize(("num_items", "num_labels"), [(4, 262_000), (1, 1_048_000), (1, 1)])
def test_a_score_whose_answer_fits_is_taken(num_items: int, num_labels: int) -> None:
    assert _answer_bytes(num_items, num_labels) <= CLIENT_LIMIT
    assert len(score_from_proto(_score(num_items, num_labels)).items) == num_items


def _bad(message: pb.GenerateRequest | pb.ScoreRequest) -> bytes:
    body = message.SerializeToString()
    assert body.count(MARK.encode()) == 1
    return body.replace(MARK.encode(), b"\xed\xa0\x80\xff\xc0\x80\xfe\xfe")  # surrogate, ...


@pytest.mark.parametrize(
    ("message", "path"),
    [
        (pb.GenerateRequest(request_id=MARK), "request_id"),
        (pb.GenerateRequest(prompt=pb.Prompt(text=MARK)), "prompt.text"),
        (
            pb.GenerateRequest(sampling=pb.SamplingParams(stop=["ok", MARK])),
            "sampling.stop[1]",
        ),
        (pb.GenerateRequest(cache_salt=MARK), "cache_salt"),
        (
            pb.ScoreRequest(
                items=[
                    pb.Prompt(text="ok"),
                    pb.Prompt(
                        chat=pb.ChatMessages(
                            messages=[
                                pb.ChatMessage(role="user", content="x"),
                                pb.ChatMessage(role=MARK, content="y"),
                            ]
                        )
                    ),
                ]
            ),
            "items[1].chat.messages[1].role",
        ),
    ],
)
def test_invalid_utf8_is_named_by_its_field(
    message: pb.GenerateRequest | pb.ScoreRequest, path: str
) -> None:
    reason = undecodable_reason(message.DESCRIPTOR, _bad(message))
    assert reason == (
        f"request body is not a valid {message.DESCRIPTOR.full_name} message: "
        f"{path} is not valid UTF-8"
    )


@pytest.mark.parametrize("body", [b"\x0a\x05ab", b"\x0b" * 200, b"\xff\xff\xff"])
def test_a_body_broken_otherwise_names_the_message(body: bytes) -> None:
    reason = undecodable_reason(pb.TokenizeRequest.DESCRIPTOR, body)
    assert reason == "request body is not a valid cachesvc.v1.TokenizeRequest message"


@pytest.mark.parametrize("request_id", ["line\r\nbreak", "nul\x00", "bell\x07", "c1\x85"])
def test_a_request_id_with_control_characters_is_refused_on_both_rpcs(request_id: str) -> None:
    generate = pb.GenerateRequest(request_id=request_id, prompt=pb.Prompt(text="hi"))
    with pytest.raises(InvalidInput, match="request_id must hold no control characters"):
        generate_from_proto(generate, CONFIG)
    score = _score(1, 1)
    score.request_id = request_id
    with pytest.raises(InvalidInput, match="request_id must hold no control characters"):
        score_from_proto(score)


def test_printable_unicode_ids_and_any_salt_are_taken() -> None:
    request = pb.GenerateRequest(
        request_id="réq-\u202e-\U0001f600", prompt=pb.Prompt(text="hi"), cache_salt="a\x00b"
    )
    assert generate_from_proto(request, CONFIG).cache_salt == "a\x00b"


def test_max_tokens_set_says_whether_the_client_chose_it() -> None:
    unset = pb.GenerateRequest(prompt=pb.Prompt(text="hi"))
    explicit = pb.GenerateRequest(
        prompt=pb.Prompt(text="hi"), sampling=pb.SamplingParams(max_tokens=16)
    )
    assert not generate_from_proto(unset, CONFIG).max_tokens_set
    assert generate_from_proto(explicit, CONFIG).max_tokens_set
