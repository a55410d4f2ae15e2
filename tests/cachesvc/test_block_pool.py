"""Block pool: ref counts, LRU eviction order, hash registration, and a state machine."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachesvc.block_pool import BlockPool, NoFreeBlocksError
from cachesvc.types import BlockHash, BlockId


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
    """Drives the pool against a dict model of reference counts and registered hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(8)
        self.refs: dict[int, int] = {}
        self.hashes: dict[bytes, int] = {}

    @rule(n=st.integers(1, 4))
    def allocate(self, n: int) -> None:
        free = 8 - len(self.refs)
        if n > free:
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            return
        for blk in self.pool.allocate(n):
            assert blk not in self.refs
            # Reusing a block evicts whatever hash it held.
            self.hashes = {h: b for h, b in self.hashes.items() if b != blk}
            self.refs[blk] = 1

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
        assert self.pool.num_free == 8 - len(self.refs)
        assert self.pool.num_cached == len(self.hashes)
        for blk, ref in self.refs.items():
            assert self.pool.ref_count(BlockId(blk)) == ref


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_events_number_stores_and_removals() -> None:
    from cachesvc.events import BlockRemoved, BlockStored, Cleared

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
