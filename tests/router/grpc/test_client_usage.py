"""What `cachesvc generate --server ... --json` prints of a request's usage: a handed-off
request also names the worker that computed its prompt and the KV that moved; others print
the same keys as offline generation."""

from __future__ import annotations

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from router.grpc.client import _apply_usage, _empty


def test_a_handed_off_request_names_its_prefill_worker() -> None:
    sample = _empty("hi", [1, 2])
    usage = pb.Usage(computed_tokens=17, worker_id="worker-1", ttft_ms=5.0)
    usage.prefill_worker_id = "worker-0"
    usage.kv_transfer_tokens = 16
    _apply_usage(sample, usage)
    assert (sample["worker_id"], sample["prefill_worker_id"]) == ("worker-1", "worker-0")
    assert sample["kv_transfer_tokens"] == 16


def test_a_colocated_request_prints_no_hand_off_keys() -> None:
    sample = _empty("hi", [1, 2])
    _apply_usage(sample, pb.Usage(computed_tokens=2, worker_id="worker-0"))
    assert "prefill_worker_id" not in sample and "kv_transfer_tokens" not in sample
    assert set(sample) == set(_empty("hi", [1, 2]))
