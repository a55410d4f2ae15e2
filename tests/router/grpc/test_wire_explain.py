"""The cache explanation on the wire: asked by GenerateRequest.explain_cache, answered in
Usage.explanation, absent when not asked."""

from __future__ import annotations

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.config import RouterConfig
from router.grpc.wire import delta_to_proto, generate_from_proto
from router.request.explain import COMPUTED, LAST_BLOCK, CacheSegment, ExplainedUsage
from workers.protocol import StreamDelta, Usage


def test_request_flags_are_carried() -> None:
    msg = pb.GenerateRequest(prompt=pb.Prompt(text="hi"), explain_cache=True, skip_cache_read=True)
    req = generate_from_proto(msg, RouterConfig())
    assert req.explain_cache and req.skip_cache_read
    req = generate_from_proto(pb.GenerateRequest(prompt=pb.Prompt(text="hi")), RouterConfig())
    assert not req.explain_cache and not req.skip_cache_read


def test_usage_explanation() -> None:
    segments = (CacheSegment(0, 16, "hbm", "w1"), CacheSegment(16, 20, COMPUTED, "w1", LAST_BLOCK))
    usage = ExplainedUsage(20, 1, {"hbm": 16}, 4, 1.0, None, "w1", explanation=segments)
    out = delta_to_proto("r", StreamDelta(0, (1,), "x", "stop", usage))
    got = [
        (s.start_token, s.end_token, s.source, s.worker_id, s.miss_reason)
        for s in out.usage.explanation.segments
    ]
    assert got == [(0, 16, "hbm", "w1", ""), (16, 20, COMPUTED, "w1", LAST_BLOCK)]
    assert out.usage.cached_tokens["hbm"] == 16
    plain = delta_to_proto(
        "r", StreamDelta(0, (1,), "x", "stop", Usage(20, 1, {}, 20, 1.0, None, "w1"))
    )
    assert not plain.usage.HasField("explanation")
