"""Block pool: ref counts, LRU eviction order, hash registration, and a state machine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachesvc.kv.block_pool import BlockPool, NoFreeBlocksError
from cachesvc.kv.types import BlockHash, BlockId


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free == 1
    pool.free(ids)
    assert pool.num_free == 4
    pool.check_integrity()


def test_allocate_too_many_changes_nothing() -> None:
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_integrity()


def test_cached_free_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(blk, BlockHash(h), [int(blk)])
    pool.free([b, a, c])  # b is the least recently freed
    [taken] = pool.allocate(1)
    assert taken == b
    assert pool.lookup(BlockHash(b"b"), [int(b)]) is None
    assert pool.lookup(BlockHash(b"a"), [int(a)]) == a
    pool.check_integrity()


def test_a_copy_freed_to_the_front_is_evicted_before_older_blocks() -> None:
    """`evict_first` (a hand-off's copy, kept by the worker that computed it): its blocks are
    evicted before blocks freed earlier, tail first; a block still shared stays in use."""
    pool = BlockPool(5)
    old, head, tail, shared, spare = pool.allocate(5)
    for blk in (old, head, tail, shared):
        pool.register(blk, BlockHash(bytes([int(blk)])), [int(blk)])
    pool.touch([shared])  # another request holds it too
    pool.free([old])
    pool.free([tail, head, shared], evict_first=True)
    assert pool.ref_count(shared) == 1 and pool.num_free == 3
    assert pool.allocate(2) == [tail, head]
    assert pool.lookup(BlockHash(bytes([int(old)])), [int(old)]) == old
    pool.free([spare])  # freed the usual way: behind the cached old block
    assert pool.allocate(1) == [old]
    pool.check_integrity()


def test_lookup_checks_token_ids() -> None:
    pool = BlockPool(2)
    [blk] = pool.allocate(1)
    pool.register(blk, BlockHash(b"h"), [1, 2, 3])
    assert pool.lookup(BlockHash(b"h"), [1, 2, 3]) == blk
    assert pool.lookup(BlockHash(b"h"), [1, 2, 4]) is None  # a hash collision is a miss


def test_touch_revives_a_cached_free_block() -> None:
    pool = BlockPool(2)
    [blk] = pool.allocate(1)
    pool.register(blk, BlockHash(b"h"), [7])
    pool.free([blk])
    pool.touch([blk])
    assert pool.ref_count(blk) == 1 and pool.num_free == 1
    pool.allocate(1)  # must take the other block, not evict the touched one
    assert pool.lookup(BlockHash(b"h"), [7]) == blk
    pool.check_integrity()


def test_double_free_is_caught() -> None:
    pool = BlockPool(1)
    [blk] = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(AssertionError):
        pool.free([blk])


class PoolMachine(RuleBasedStateMachine):
    """Drives the pool against a dict model of reference counts and registered hashes, with an
    eviction hook that sometimes raises (a failing demotion) and checks the pool it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.refs: dict[int, int] = {}
        self.hashes: dict[bytes, int] = {}
        self.raising = False
        self.num_hook_calls = 0
        self.num_raised = 0
        self.pool.on_evict = self._hook

    def _hook(
        self, blk: BlockId, h: BlockHash, tokens: tuple[int, ...], parent: BlockHash | None
    ) -> None:
        # The pool is whole before any hook runs: the block is unregistered and unmatchable,
        # though still counted as held (its KV is intact until `allocate` returns).
        self.pool.check_integrity()
        assert self.pool.block_hash(blk) is None and self.pool.lookup(h, tokens) is None
        assert self.pool.contains(h)
        self.num_hook_calls += 1
        if self.raising:
            self.num_raised += 1
            raise OSError("demotion failed")

    @rule(n=st.integers(1, 4), raising=st.booleans())
    def allocate(self, n: int, raising: bool) -> None:
        self.raising = raising
        free = 8 - len(self.refs)
        if n > free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        calls = self.num_hook_calls
        got = self.pool.allocate(n)
        evicted = [h for h, b in self.hashes.items() if b in got]
        assert self.num_hook_calls - calls == len(evicted)  # one call per evicted block
        assert not any(self.pool.contains(BlockHash(h)) for h in evicted)
        for blk in got:
            assert blk not in self.refs
            # Reusing a block evicts whatever hash it held.
            self.hashes = {h: b for h, b in self.hashes.items() if b != blk}
            self.refs[blk] = 1

    @rule(demote=st.booleans(), raising=st.booleans())
    def reset_cache(self, demote: bool, raising: bool) -> None:
        self.raising = raising
        calls = self.num_hook_calls
        cached_free = [h for h, b in self.hashes.items() if b not in self.refs]
        assert self.pool.reset_cache(demote=demote) == len(cached_free)
        assert self.num_hook_calls - calls == (len(cached_free) if demote else 0)
        self.hashes = {h: b for h, b in self.hashes.items() if b in self.refs}

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        blk = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.free([BlockId(blk)])
        self.refs[blk] -= 1
        if self.refs[blk] == 0:
            del self.refs[blk]

    @precondition(lambda self: self.refs)
    @rule(data=st.data(), tag=st.binary(min_size=1, max_size=2))
    def register(self, data: st.DataObject, tag: bytes) -> None:
        blk = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.register(BlockId(blk), BlockHash(tag), [blk])
        if tag not in self.hashes and blk not in self.hashes.values():
            self.hashes[tag] = blk

    @precondition(lambda self: self.hashes)
    @rule(data=st.data())
    def touch_cached(self, data: st.DataObject) -> None:
        tag = data.draw(st.sampled_from(sorted(self.hashes)))
        blk = self.pool.lookup(BlockHash(tag), [self.hashes[tag]])
        assert blk == self.hashes[tag]
        self.pool.touch([blk])
        self.refs[blk] = self.refs.get(blk, 0) + 1

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_integrity()
        assert self.pool.num_evict_hook_failures == self.num_raised
        assert self.pool.num_free == 8 - len(self.refs)
        assert self.pool.num_cached == len(self.hashes)
        for blk, ref in self.refs.items():
            assert self.pool.ref_count(BlockId(blk)) == ref


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_events_number_stores_and_removals() -> None:
    from cachesvc.kv.events import BlockRemoved, BlockStored, Cleared

    pool = BlockPool(1)
    [blk] = pool.allocate(1)
    pool.register(blk, BlockHash(b"x"), [1], parent=BlockHash(b"p"))
    pool.free([blk])
    pool.allocate(1)  # evicts x
    pool.free([blk])
    pool.reset_cache()
    events = pool.events.drain()
    assert events == [
        BlockStored(0, "hbm", (BlockHash(b"x"),), BlockHash(b"p")),
        BlockRemoved(1, "hbm", (BlockHash(b"x"),)),
        Cleared(2, "hbm"),
    ]
    assert pool.events.drain() == []


def _cached_free_pool(num: int) -> tuple[BlockPool, list[BlockId]]:
    """A pool of `num` blocks, each cached under hash i (a chain 0 <- 1 <- ...) and free."""
    pool = BlockPool(num)
    ids = pool.allocate(num)
    for i, blk in enumerate(ids):
        pool.register(blk, BlockHash(bytes([i])), [i], BlockHash(bytes([i - 1])) if i else None)
    pool.free(list(reversed(ids)))  # tail first, as a request frees
    pool.events.drain()
    return pool, ids


def test_a_raising_evict_hook_is_a_counted_miss() -> None:
    from cachesvc.kv.events import BlockRemoved

    pool, _ = _cached_free_pool(3)
    seen: list[bytes] = []

    def hook(blk: BlockId, h: BlockHash, tokens: tuple[int, ...], parent: BlockHash | None):
        seen.append(h)
        raise RuntimeError("tier failed")

    pool.on_evict = hook
    got = pool.allocate(2)  # evicts the chain's tail (hashes 2, then 1)
    assert len(got) == 2 and [pool.ref_count(b) for b in got] == [1, 1]
    assert seen == [b"\x02", b"\x01"] and pool.num_evict_hook_failures == 2
    assert pool.num_cached == 1 and pool.num_free == 1
    assert pool.events.drain() == [
        BlockRemoved(3, "hbm", (BlockHash(b"\x02"),)),
        BlockRemoved(4, "hbm", (BlockHash(b"\x01"),)),
    ]
    pool.check_integrity()
    pool.free(got)
    assert pool.reset_cache() == 1 and pool.num_evict_hook_failures == 3
    pool.check_integrity()


def test_reset_cache_without_demotion_runs_no_hook() -> None:
    pool, _ = _cached_free_pool(3)
    calls: list[bytes] = []
    pool.on_evict = lambda blk, h, tokens, parent: calls.append(h)
    assert pool.reset_cache(demote=False) == 3
    assert calls == [] and pool.num_cached == 0
    pool.check_integrity()


def test_unregister_forgets_blocks_in_use_without_the_hook() -> None:
    from cachesvc.kv.events import BlockRemoved

    pool = BlockPool(4)
    calls: list[bytes] = []
    pool.on_evict = lambda blk, h, tokens, parent: calls.append(h)
    a, b, c = pool.allocate(3)
    assert pool.register(a, BlockHash(b"a"), [1]) and pool.register(b, BlockHash(b"b"), [2])
    assert not pool.register(c, BlockHash(b"a"), [1])  # taken: c stays private
    pool.events.drain()
    assert pool.unregister([a, b, c]) == 2
    assert pool.lookup(BlockHash(b"a"), [1]) is None and not pool.contains(BlockHash(b"b"))
    assert [pool.ref_count(x) for x in (a, b, c)] == [1, 1, 1]  # still their owners'
    assert pool.events.drain() == [BlockRemoved(2, "hbm", (BlockHash(b"a"), BlockHash(b"b")))]
    pool.free([c, b, a])
    pool.allocate(4)
    assert calls == []  # nothing left to demote: their hashes were gone
    pool.check_integrity()


def test_a_lossy_mark_holds_through_the_evict_hook_and_goes_with_reuse() -> None:
    """The hook demoting an evicted block still sees its mark (so its lossy KV is not stored
    as exact); the block handed out for new KV carries none, nor does one whose hash is reset."""
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(blk, BlockHash(h), [int(blk)])
    pool.mark_lossy([a, b])
    assert pool.is_lossy(a) and not pool.is_lossy(c)
    assert pool.any_lossy([c, b]) and not pool.any_lossy([c])
    pool.free([a, b, c])  # still cached, still marked: a request matching them reads lossy KV
    assert pool.lookup(BlockHash(b"a"), [int(a)]) == a and pool.is_lossy(a)
    seen: list[tuple[bytes, bool]] = []
    pool.on_evict = lambda blk, h, tokens, parent: seen.append((h, pool.is_lossy(blk)))
    [taken] = pool.allocate(1)
    assert taken == a and seen == [(b"a", True)] and not pool.is_lossy(a)
    pool.check_integrity()
    pool.free([taken])
    assert pool.reset_cache() == 2  # b and c, with the hook
    assert seen[1:] == [(b"b", True), (b"c", False)]
    assert not pool.any_lossy([a, b, c])
    pool.check_integrity()
