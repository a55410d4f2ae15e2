"""The request the live benches send: greedy token ids, every token generated (no early end of
sequence), past the response cache (the KV path is what they measure)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any


def greedy_request(ids: Sequence[int], max_tokens: int, id_prefix: str) -> Any:
    """A `GenerateRequest` for `ids`, answered with `max_tokens` greedy tokens, its request id
    `id_prefix` and a random suffix."""
    from proto.cachesvc.v1 import cachesvc_pb2 as pb

    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        no_response_cache=True,
        request_id=f"{id_prefix}-{uuid.uuid4().hex[:8]}",
    )
