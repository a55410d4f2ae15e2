"""The explanation of a prompt's cache hits and misses: segments, merges, reasons, salts."""

from __future__ import annotations

import pytest

from cachesvc.kv.events import BlockRemoved, BlockStored
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.index import IndexSnapshot, MemoryPrefixIndex
from cachesvc.kv.types import BlockHash, WorkerId
from router.pool.ghosts import GhostRecord
from router.request.explain import (
    COMPUTED,
    EVICTED,
    EXPIRED,
    LAST_BLOCK,
    NEVER_CACHED,
    OTHER_WORKER,
    SKIPPED,
    CacheSegment,
    ExplainedUsage,
    block_misses,
    explain,
    explained,
    explanation_of,
    unexplained,
)
from workers.protocol import StreamDelta, Usage

BS = 4
A, B = WorkerId("a"), WorkerId("b")


def _rows(segments: tuple[CacheSegment, ...]) -> list[tuple[int, int, str, str]]:
    assert all(s.worker_id == "w" for s in segments)
    return [(s.start_token, s.end_token, s.source, s.miss_reason) for s in segments]


@pytest.mark.parametrize(
    ("prompt_len", "cached", "misses", "expected"),
    [
        # Nothing cached, partial last block: every full block has its reason.
        (
            10,
            {},
            [NEVER_CACHED] * 2,
            [(0, 8, COMPUTED, NEVER_CACHED), (8, 10, COMPUTED, LAST_BLOCK)],
        ),
        # An exact multiple: the last full block holds the last token, so it is "last_block".
        (
            12,
            {},
            [NEVER_CACHED] * 3,
            [(0, 8, COMPUTED, NEVER_CACHED), (8, 12, COMPUTED, LAST_BLOCK)],
        ),
        # Tiers in their order along the prompt, whatever the mapping's order; a zero tier is
        # no segment.
        (
            14,
            {"dram": 4, "hbm": 4, "nvme": 0},
            [EVICTED] * 3,
            [
                (0, 4, "hbm", ""),
                (4, 8, "dram", ""),
                (8, 12, COMPUTED, EVICTED),
                (12, 14, COMPUTED, LAST_BLOCK),
            ],
        ),
        # Reasons change block by block; equal neighbours merge.
        (
            21,
            {"hbm": 4},
            [EVICTED, OTHER_WORKER, OTHER_WORKER, EXPIRED, NEVER_CACHED],
            [
                (0, 4, "hbm", ""),
                (4, 12, COMPUTED, OTHER_WORKER),
                (12, 16, COMPUTED, EXPIRED),
                (16, 20, COMPUTED, NEVER_CACHED),
                (20, 21, COMPUTED, LAST_BLOCK),
            ],
        ),
        # A repeat: all but the last block from the device.
        (12, {"hbm": 8}, [EVICTED] * 3, [(0, 8, "hbm", ""), (8, 12, COMPUTED, LAST_BLOCK)]),
        # A peer's blocks after the device's; a prompt shorter than a block.
        (
            9,
            {"hbm": 4, "peer": 4},
            [],
            [(0, 4, "hbm", ""), (4, 8, "peer", ""), (8, 9, COMPUTED, LAST_BLOCK)],
        ),
        (3, {}, [], [(0, 3, COMPUTED, LAST_BLOCK)]),
        (0, {}, [], []),
        # A resumed request's longer prompt: blocks past the known ones were never cached.
        (
            13,
            {},
            [SKIPPED],
            [
                (0, 4, COMPUTED, SKIPPED),
                (4, 12, COMPUTED, NEVER_CACHED),
                (12, 13, COMPUTED, LAST_BLOCK),
            ],
        ),
    ],
)
def test_segments(
    prompt_len: int,
    cached: dict[str, int],
    misses: list[str],
    expected: list[tuple[int, int, str, str]],
) -> None:
    segments = explain(prompt_len, BS, cached, "w", misses)
    assert _rows(segments) == expected
    # Consecutive, covering the prompt, none empty.
    assert [s.start_token for s in segments[1:]] == [s.end_token for s in segments[:-1]]
    assert all(s.start_token < s.end_token for s in segments)
    if segments:
        assert (segments[0].start_token, segments[-1].end_token) == (0, prompt_len)


def test_cached_past_the_prompt_is_clipped() -> None:
    assert _rows(explain(8, BS, {"hbm": 12}, "w", [])) == [(0, 8, "hbm", "")]


def _hashes(salt: str, num_blocks: int) -> list[BlockHash]:
    return hash_blocks(list(range(num_blocks * BS)), BS, root_hash("m", BS, salt))


def _index(held: dict[WorkerId, list[BlockHash]]) -> MemoryPrefixIndex:
    index = MemoryPrefixIndex()
    for worker, hashes in held.items():
        index.resync(worker, IndexSnapshot("life", 0, {"hbm": hashes}))
    return index


def test_reasons_per_block() -> None:
    hashes = _hashes("tenant:x", 5)
    clock = [0.0]
    ghosts = GhostRecord(clock=lambda: clock[0])
    # b holds the first two blocks; block 2 was evicted, block 3 too after its retention ran
    # out; block 4 was never cached.
    index = _index({B: hashes[:2]})
    ghosts.retained(hashes[3:4], 10.0)
    ghosts.observe([BlockRemoved(0, "hbm", (hashes[2],))])
    clock[0] = 11.0
    ghosts.observe([BlockRemoved(1, "hbm", (hashes[3],))])
    misses = block_misses(hashes, index.longest_prefix(hashes), ghosts, A, skip_read=False)
    assert misses == (OTHER_WORKER, OTHER_WORKER, EVICTED, EXPIRED, NEVER_CACHED)
    # Routed to the holder: what it held and did not read counts as evicted, not as another's.
    misses = block_misses(hashes, index.longest_prefix(hashes), ghosts, B, skip_read=False)
    assert misses[:2] == (EVICTED, EVICTED)
    # skip_cache_read: every block was skipped, whoever holds it.
    assert block_misses(hashes, index.longest_prefix(hashes), ghosts, A, True) == (SKIPPED,) * 5


def test_a_removal_before_its_retention_ran_out_is_evicted() -> None:
    hashes = _hashes("", 1)
    clock = [0.0]
    ghosts = GhostRecord(clock=lambda: clock[0])
    ghosts.retained(hashes, 10.0)
    clock[0] = 5.0
    ghosts.observe([BlockRemoved(0, "hbm", tuple(hashes))])
    clock[0] = 20.0  # expiring after the removal does not make it "expired"
    assert block_misses(hashes, {}, ghosts, A, False) == (EVICTED,)


def test_another_tenants_blocks_explain_nothing() -> None:
    """The same tokens under another tenant's salt are other hashes: neither its cached blocks
    nor its evicted ones show in this tenant's explanation."""
    mine, theirs = _hashes("tenant:mine", 3), _hashes("tenant:theirs", 3)
    assert not set(mine) & set(theirs)
    ghosts = GhostRecord()
    ghosts.observe([BlockRemoved(0, "hbm", (theirs[2],))])
    index = _index({B: theirs[:2]})
    misses = block_misses(mine, index.longest_prefix(mine), ghosts, A, False)
    assert misses == (NEVER_CACHED,) * 3
    # Theirs, routed the same way, see their own blocks.
    misses = block_misses(theirs, index.longest_prefix(theirs), ghosts, A, False)
    assert misses == (OTHER_WORKER, OTHER_WORKER, EVICTED)


def test_stored_again_is_no_longer_evicted() -> None:
    hashes = _hashes("", 2)
    ghosts = GhostRecord()
    ghosts.observe([BlockRemoved(0, "hbm", tuple(hashes))])
    ghosts.observe([BlockStored(1, "dram", (hashes[0],))])
    assert block_misses(hashes, {}, ghosts, A, False) == (NEVER_CACHED, EVICTED)


def _usage(**kw: object) -> Usage:
    base: dict[str, object] = dict(
        prompt_tokens=10,
        completion_tokens=2,
        cached_tokens={"hbm": 4},
        computed_tokens=6,
        ttft_ms=1.0,
        decode_tokens_per_s=None,
        worker_id="w-1",
    )
    return Usage(**{**base, **kw})  # type: ignore[arg-type]


def test_explained_keeps_the_usage_and_adds_segments() -> None:
    usage = _usage(cache_write_tokens=4)
    delta = explained(StreamDelta(0, (1,), "x", "stop", usage), BS, [EVICTED, NEVER_CACHED])
    assert isinstance(delta.usage, ExplainedUsage)
    assert delta.usage.cache_write_tokens == 4 and delta.usage.worker_id == "w-1"
    assert explanation_of(delta.usage) == (
        CacheSegment(0, 4, "hbm", "w-1"),
        CacheSegment(4, 8, COMPUTED, "w-1", NEVER_CACHED),
        CacheSegment(8, 10, COMPUTED, "w-1", LAST_BLOCK),
    )
    assert explanation_of(usage) is None
    no_usage = StreamDelta(0, (1,), "x")
    assert explained(no_usage, BS, []) is no_usage


def test_unexplained_is_the_workers_usage_again() -> None:
    """What the response cache stores: a plain Usage, which its entries' checks accept."""
    usage = _usage(cache_write_tokens=4)
    delta = explained(StreamDelta(0, (1,), "x", "stop", usage), BS, [NEVER_CACHED] * 2)
    plain = unexplained(delta)
    assert type(plain.usage) is Usage and plain.usage == usage
    assert plain.token_ids == delta.token_ids and plain.finish_reason == "stop"
