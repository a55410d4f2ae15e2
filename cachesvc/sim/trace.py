"""The requests the simulator replays: a Mooncake trace at full size, the sample `cachesvc bench
routing` sends, or the hot-prefix workload; and the oracle.

Each trace hash id stands for one block of `MOONCAKE_BLOCK_TOKENS` tokens, and equal ids mean an
equal prefix, so an id is already what our rolling block hash is: the simulator uses it as the
block's hash directly (16 bytes), with blocks of the trace's size. As in the engine, only full
blocks of a prompt are registered, and a match stops before the block of the prompt's last
token (its logits are needed). The other two are token-id sessions (`workloads`), hashed as the
workers hash them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.types import BlockHash
from cachesvc.workloads.sessions import (
    MOONCAKE_BLOCK_TOKENS,
    Session,
    TraceRow,
    TraceScale,
    hot_prefix_workload,
    load_mooncake,
    trace_workload,
)

BLOCK_SIZE = MOONCAKE_BLOCK_TOKENS
BENCH_VOCAB_SIZE = 49152  # the default model's: token values only decide which blocks are equal


def block_hash(hash_id: int) -> BlockHash:
    """The block hash standing for a trace hash id (any id, the same hash everywhere)."""
    return BlockHash(hash_id.to_bytes(16, "little", signed=True))


@dataclass(frozen=True)
class SimRequest:
    """One request of the replay: when it arrives, its sizes, its blocks' hashes."""

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    hashes: tuple[BlockHash, ...]  # one per block; the last may be partial
    block_size: int = BLOCK_SIZE
    timed: bool = True  # False: served but left out of the TTFT figures (hot-prefix's parent)

    @property
    def num_full_blocks(self) -> int:
        """Blocks the engine registers: the prompt's full ones."""
        return min(len(self.hashes), self.prompt_len // self.block_size)

    @property
    def max_match_blocks(self) -> int:
        """Blocks a cache hit may cover: all but the one holding the last prompt token."""
        return min(len(self.hashes), (self.prompt_len - 1) // self.block_size)


def load_trace(
    path: str | Path, time_scale: float = 1.0, max_requests: int | None = None
) -> list[SimRequest]:
    """The first `max_requests` rows of a Mooncake JSONL trace (all by default), arrivals in
    seconds from the first, multiplied by `time_scale` (0.5 replays at twice the rate)."""
    return trace_requests(load_mooncake(path)[:max_requests], time_scale)


def replicate_users(rows: Sequence[TraceRow], copies: int) -> list[TraceRow]:
    """`copies` copies of the trace's users: each copy's hash ids are its own (a copy shares no
    block with another), so a bigger cluster sees more sessions of the same shapes rather than
    the same sessions faster. Copy c arrives c / copies of the trace's mean gap between requests
    after the original: the copies keep the trace's own rhythm (its bursts, per worker, stay as
    big as in the original on `copies` times the workers) without arriving at the same instant.
    """
    if copies < 1:
        raise ValueError(f"a trace needs at least one copy of its users, got {copies}")
    if copies == 1 or not rows:
        return list(rows)
    stride = max(max(r.hash_ids) for r in rows) + 1
    times = [r.timestamp_ms for r in rows]
    gap_ms = (max(times) - min(times)) / len(rows)
    return [
        dataclasses.replace(
            r,
            timestamp_ms=r.timestamp_ms + c * gap_ms / copies,
            hash_ids=tuple(h + c * stride for h in r.hash_ids),
        )
        for c in range(copies)
        for r in rows
    ]


def trace_requests(rows: Sequence[TraceRow], time_scale: float = 1.0) -> list[SimRequest]:
    """Mooncake rows as requests in arrival order, in seconds from the first arrival,
    multiplied by `time_scale`."""
    if time_scale <= 0:
        raise ValueError(f"--time-scale must be positive, got {time_scale}")
    t0 = min(r.timestamp_ms for r in rows)
    rows = sorted(rows, key=lambda r: r.timestamp_ms)  # stable: equal times keep file order
    return [
        SimRequest(
            index=i,
            arrival_s=(r.timestamp_ms - t0) / 1e3 * time_scale,
            prompt_len=max(1, r.input_length),
            output_len=max(1, r.output_length),
            hashes=tuple(block_hash(h) for h in r.hash_ids),
        )
        for i, r in enumerate(rows)
    ]


def bench_routing_requests(
    path: str | Path, max_requests: int | None = None, block_size: int = 16
) -> list[SimRequest]:
    """The requests `cachesvc bench routing --workload trace` sends for this trace (its default
    `TraceScale`, with at most `max_requests`: 24 is its `--quick`), their tokens hashed as the
    workers hash them, in blocks of `block_size`."""
    scale = TraceScale()
    if max_requests is not None:
        scale = dataclasses.replace(scale, max_requests=max_requests)
    sessions = trace_workload(load_mooncake(path), BENCH_VOCAB_SIZE, scale)
    return _session_requests(sessions, block_size)


@dataclass(frozen=True)
class HotPrefix:
    """One long context forked into many sub-agents (`workloads.hot_prefix_workload`): a parent
    request computes the `prefix_len`-token context at 0; from `fork_at_s` on, `num_forks`
    requests of that context plus `suffix_len` tokens of their own, each `output_len` tokens
    long, arrive as a Poisson burst of `rate` per second."""

    prefix_len: int = 2048
    num_forks: int = 64
    suffix_len: int = 64
    output_len: int = 16
    fork_at_s: float = 1.0
    rate: float = 200.0
    block_size: int = 16  # the workers' default
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.prefix_len, self.num_forks, self.suffix_len, self.output_len) < 1:
            raise ValueError("hot-prefix lengths and the number of forks must be positive")
        if self.fork_at_s < 0 or self.rate < 0 or self.block_size < 1:
            raise ValueError("hot-prefix --fork-at and --rate must be >= 0")


def hot_prefix_requests(shape: HotPrefix) -> list[SimRequest]:
    """The hot-prefix workload as requests, in arrival order (the parent first)."""
    sessions = hot_prefix_workload(
        BENCH_VOCAB_SIZE,
        prefix_len=shape.prefix_len,
        num_forks=shape.num_forks,
        suffix_len=shape.suffix_len,
        output_len=shape.output_len,
        fork_at_s=shape.fork_at_s,
        rate=shape.rate,
        seed=shape.seed,
    )
    parent, *forks = _session_requests(sessions, shape.block_size)
    # The parent computes the context the forks share; the live bench serves it before timing
    # the forks, and so is it left out here.
    return [dataclasses.replace(parent, timed=False), *forks]


def _session_requests(sessions: Sequence[Session], block_size: int) -> list[SimRequest]:
    """One request per one-turn session: prefix and question, hashed in blocks of
    `block_size` as the workers hash them."""
    root = root_hash("simulated", block_size)
    out = []
    for i, session in enumerate(sessions):
        [turn] = session.turns
        ids = [*session.prefix_ids, *turn.question_ids]
        hashes = hash_blocks(ids, block_size, root)
        out.append(
            SimRequest(i, session.arrival_s, len(ids), turn.max_tokens, tuple(hashes), block_size)
        )
    return out


def num_unique_blocks(requests: Sequence[SimRequest]) -> int:
    """Distinct blocks of the trace (its hash ids)."""
    return len({h for r in requests for h in r.hashes})


def oracle_hit_blocks(requests: Sequence[SimRequest]) -> list[int]:
    """Per request, the blocks one infinite cache that has seen every earlier request (in
    arrival order) would hit: the ideal any routing could reach."""
    seen: set[BlockHash] = set()
    hits = []
    for r in requests:
        n = 0
        while n < r.max_match_blocks and r.hashes[n] in seen:
            n += 1
        hits.append(n)
        seen.update(r.hashes[: r.num_full_blocks])
    return hits
