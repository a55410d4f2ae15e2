"""Proto -> router types: each bad field is refused with a message that names it."""

from __future__ import annotations

from typing import Any

import pytest

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.config import RouterConfig
from router.domain import InvalidInput
from router.grpc.wire import generate_from_proto, score_from_proto

CONFIG = RouterConfig(max_n=4)


def _req(prompt: pb.Prompt | None = None, **sampling: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=prompt or pb.Prompt(text="hello"), sampling=pb.SamplingParams(**sampling)
    )


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.GenerateRequest(), "prompt must be set"),
        (_req(pb.Prompt(token_ids=pb.TokenIds())), "prompt.token_ids must not be empty"),
        (
            _req(pb.Prompt(chat=pb.ChatMessages(messages=[pb.ChatMessage(content="x")]))),
            "prompt.chat.messages[0].role",
        ),
        (_req(max_tokens=0), "sampling.max_tokens must be >= 1"),
        (_req(max_tokens=-5), "sampling.max_tokens"),
        (_req(temperature=-0.1), "sampling.temperature"),
        (_req(temperature=float("nan")), "sampling.temperature"),
        (_req(top_p=2.0), "sampling.top_p must be in (0, 1]"),
        (_req(top_p=0.0), "sampling.top_p"),
        (_req(top_k=-1), "sampling.top_k"),
        (_req(n=0), "sampling.n must be in [1, 4]"),
        (_req(n=1_000_000), "sampling.n"),
        (_req(beam_width=0), "sampling.beam_width"),
        (_req(stop=["ok", ""]), "sampling.stop[1]"),
        (pb.GenerateRequest(request_id="x" * 300, prompt=pb.Prompt(text="a")), "request_id"),
    ],
)
def test_bad_generate_fields_are_named(request_: pb.GenerateRequest, field: str) -> None:
    with pytest.raises(InvalidInput) as err:
        generate_from_proto(request_, CONFIG)
    assert field in str(err.value)


def test_defaults_of_unset_optional_fields() -> None:
    req = generate_from_proto(pb.GenerateRequest(prompt=pb.Prompt(text="hi")), CONFIG)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed) == (16, 1.0, 1.0, 1, None)
    assert req.cache_salt is None and p.beam_width == 1


def test_explicit_values_are_kept() -> None:
    msg = _req(max_tokens=3, temperature=0.0, seed=0, stop_token_ids=[5], ignore_eos=True, n=2)
    msg.cache_salt = ""
    req = generate_from_proto(msg, CONFIG)
    assert (req.params.max_tokens, req.params.temperature, req.params.seed) == (3, 0.0, 0)
    assert req.params.stop_token_ids == (5,) and req.params.ignore_eos and req.params.n == 2
    assert req.cache_salt == ""


def test_engine_rules_are_reported_as_sampling_errors() -> None:
    with pytest.raises(InvalidInput, match="^sampling: n must be 1 with beam search"):
        generate_from_proto(_req(beam_width=2, n=2), CONFIG)


def test_score_items_must_be_text_or_ids() -> None:
    msg = pb.ScoreRequest(
        prefix=pb.Prompt(text="q"),
        items=[pb.Prompt(text="a"), pb.Prompt(chat=pb.ChatMessages())],
        label_token_ids=[1],
    )
    with pytest.raises(InvalidInput, match=r"items\[1\]"):
        score_from_proto(msg)
