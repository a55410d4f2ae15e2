"""What a worker actor sends: stream deltas built from the engine's snapshots, and where it runs.
Plain translation, no state: the actor (`workers.actor`) stays a thin edge."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachesvc.kv.events import TIER_HBM
from workers.protocol import PEER_TOKENS, StreamDelta, Usage

if TYPE_CHECKING:
    from workers.engine.outputs import RequestOutput


def stream_delta(
    out: RequestOutput,
    request_id: str,
    n: int,
    sent: dict[int, int],
    worker_id: str,
    prefetched: int = 0,
) -> StreamDelta:
    """The delta of one sample's snapshot `out` of request `request_id` (of `n` samples): the
    tokens not sent yet (`sent` counts them per sample, updated), and its usage at its end.
    `prefetched`: prompt tokens a prefetch pulled from a peer into the device pool for this
    request; counted as the peer's, not the device's, where the request found them there."""
    index = 0 if n == 1 else int(out.request_id[len(request_id) + 1 :])
    start = sent.get(index, 0)
    sent[index] = len(out.token_ids)
    usage = None
    if out.finished:
        cached = dict(out.cached_tokens_by_tier) or {TIER_HBM: out.num_cached_tokens}
        moved = min(prefetched, cached.get(TIER_HBM, 0))
        if moved:
            cached[TIER_HBM] -= moved
            cached[PEER_TOKENS] = cached.get(PEER_TOKENS, 0) + moved
            if not cached[TIER_HBM]:
                del cached[TIER_HBM]
        usage = Usage(
            prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids),
            cached_tokens=cached,
            computed_tokens=out.num_computed_tokens,
            cache_write_tokens=out.num_cache_write_tokens,
            retained_tokens=out.num_retained_tokens,
            retention_trimmed_tokens=out.num_retention_trimmed_tokens,
            ttft_ms=out.ttft_ms or 0.0,
            decode_tokens_per_s=out.decode_tokens_per_s,
            worker_id=worker_id,
            lossy_kv=out.lossy_kv,
        )
    stop = out.stop_sequence if out.finished else None
    return StreamDelta(
        index, tuple(out.token_ids[start:]), out.delta_text, out.finish_reason, usage, stop
    )


def ray_node() -> dict[str, str | None]:
    """The id and IP address of the Ray node this process runs on (`WorkerInfo` fields), so an
    operator sees where a worker landed; None outside Ray (an actor made in-process)."""
    import ray

    if not ray.is_initialized():
        return {"node_id": None, "node_ip": None}
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
    }
