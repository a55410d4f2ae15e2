"""Where each part of a prompt came from, and why a part was not read from the cache.

A prompt splits into consecutive segments: first what the worker read, tier by tier in the order
it lies along the prompt (`CACHED_SOURCES`: the device's own prefix, then what its lower tiers
and a peer brought), then what it computed. A computed full block says why it was not read
(`block_misses`, decided when the request is routed, before its own blocks are stored):

- "skipped": the request asked to reuse nothing (skip_cache_read);
- "other_worker": a worker routing did not choose holds it (which one is never said);
- "evicted" / "expired": it was cached and removed (`router.pool.ghosts`), after its retention
  ran out for "expired"; also a block the chosen worker held when routed and did not read (it
  was evicted before the worker reached it, or fetching it was judged dearer than computing);
- "never_cached": none of these.

The block holding the prompt's last token is always computed ("last_block"): the partial last
block, or the last full block of a prompt that is an exact multiple of the block size.

Only the request's own hashes are looked up, and they are salted with its tenant's salt: another
tenant's blocks never explain anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import BlockHash, WorkerId
from router.pool.ghosts import GhostRecord
from workers.protocol import PEER_TOKENS, StreamDelta, Usage

CACHED_SOURCES = ("hbm", "dram", "nvme", "redis", PEER_TOKENS)  # in order along the prompt
COMPUTED = "computed"

NEVER_CACHED = "never_cached"
EVICTED = "evicted"
EXPIRED = "expired"
OTHER_WORKER = "other_worker"
SKIPPED = "skipped"
LAST_BLOCK = "last_block"


@dataclass(frozen=True)
class CacheSegment:
    """Prompt tokens [start_token, end_token) came from `source` (a tier, "peer" or
    "computed") on `worker_id`; `miss_reason` is set for "computed" only."""

    start_token: int
    end_token: int
    source: str
    worker_id: str
    miss_reason: str = ""


@dataclass(frozen=True)
class ExplainedUsage(Usage):
    """A worker's usage with the router's explanation of the prompt's cache hits and misses."""

    explanation: tuple[CacheSegment, ...] = ()


def block_misses(
    hashes: Sequence[BlockHash],
    holders: Mapping[WorkerId, PrefixMatch],
    ghosts: GhostRecord,
    worker: WorkerId,
    skip_read: bool,
) -> tuple[str, ...]:
    """Per full block of the prompt, why it is computed if the chosen `worker` does not read
    it. `holders` is the index's longest prefix of `hashes` per worker (`PrefixIndex.
    longest_prefix`), read when the request is routed. No mutation."""
    if skip_read:
        return (SKIPPED,) * len(hashes)
    own = holders[worker].num_blocks if worker in holders else 0
    others = max((m.num_blocks for w, m in holders.items() if w != worker), default=0)
    out = []
    for i, block_hash in enumerate(hashes):
        ghost = ghosts.get(block_hash)
        if i < own:
            out.append(EVICTED)  # held when routed, not read
        elif i < others:
            out.append(OTHER_WORKER)
        elif ghost is not None:
            out.append(EXPIRED if ghost.expired else EVICTED)
        else:
            out.append(NEVER_CACHED)
    return tuple(out)


def explain(
    prompt_len: int,
    block_size: int,
    cached_tokens: Mapping[str, int],
    worker_id: str,
    misses: Sequence[str],
) -> tuple[CacheSegment, ...]:
    """The prompt's segments, in order, covering [0, prompt_len); adjacent runs of the same
    source and reason merged. `misses[i]` is block i's reason when computed (`block_misses`);
    a block past them (a resumed request's longer prompt) was never cached."""
    assert block_size > 0, "a block holds at least one token"
    runs: list[tuple[int, int, str, str]] = []
    start = 0
    known = [t for t in CACHED_SOURCES if t in cached_tokens]
    for tier in known + sorted(set(cached_tokens) - set(CACHED_SOURCES)):
        end = min(prompt_len, start + max(0, cached_tokens[tier]))
        runs.append((start, end, tier, ""))
        start = end
    last_start = (prompt_len - 1) // block_size * block_size  # the block of the last token
    while start < prompt_len:
        block = start // block_size
        end = min(prompt_len, (block + 1) * block_size)
        if start >= last_start:
            reason = LAST_BLOCK
        else:
            reason = misses[block] if block < len(misses) else NEVER_CACHED
        runs.append((start, end, COMPUTED, reason))
        start = end
    return tuple(CacheSegment(s, e, src, worker_id, why) for s, e, src, why in _merged(runs))


def _merged(runs: list[tuple[int, int, str, str]]) -> list[tuple[int, int, str, str]]:
    out: list[tuple[int, int, str, str]] = []
    for start, end, source, reason in runs:
        if start == end:
            continue
        if out and out[-1][2:] == (source, reason) and out[-1][1] == start:
            out[-1] = (out[-1][0], end, source, reason)
        else:
            out.append((start, end, source, reason))
    return out


def explained(delta: StreamDelta, block_size: int, misses: Sequence[str]) -> StreamDelta:
    """`delta` with its usage explained (`ExplainedUsage`); a delta without usage as it is."""
    usage = delta.usage
    if usage is None:
        return delta
    segments = explain(
        usage.prompt_tokens, block_size, usage.cached_tokens, usage.worker_id, misses
    )
    return dataclasses.replace(delta, usage=ExplainedUsage(**_fields(usage), explanation=segments))


def unexplained(delta: StreamDelta) -> StreamDelta:
    """`delta` with its usage as the worker sent it: what the response cache stores (an
    explanation tells of one request's cache, not of a later answer's)."""
    usage = delta.usage
    if not isinstance(usage, ExplainedUsage):
        return delta
    return dataclasses.replace(delta, usage=Usage(**_fields(usage)))


def explanation_of(usage: Usage) -> tuple[CacheSegment, ...] | None:
    """The usage's explanation; None when the request did not ask one."""
    return usage.explanation if isinstance(usage, ExplainedUsage) else None


def _fields(usage: Usage) -> dict[str, Any]:
    """A usage's own fields (a Usage's, whatever subclass it is)."""
    return {f.name: getattr(usage, f.name) for f in dataclasses.fields(Usage)}
