"""The block pool under each eviction policy: `lru` hands blocks out exactly as the pool's own
ordered dict did before policies, no policy leaks a block through eviction storms, and the
pool's state machine holds over each."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import settings
from test_block_pool import PoolMachine

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.eviction.base import POLICY_NAMES
from cachesvc.kv.types import BlockHash, BlockId


class PreviousFreeQueue:
    """The pool's free queue before policies, as it was written: an ordered dict, the least
    recently freed first, `evict_first` blocks moved to its front."""

    def __init__(self, num_blocks: int) -> None:
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.refs = [0] * num_blocks

    def allocate(self, num: int) -> list[int]:
        out = [self.free.popitem(last=False)[0] for _ in range(num)]
        for b in out:
            self.refs[b] = 1
        return out

    def free_blocks(self, ids: list[int], evict_first: bool) -> None:
        front = []
        for b in ids:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
                front.append(b)
        if evict_first:
            for b in reversed(front):
                self.free.move_to_end(b, last=False)

    def touch(self, ids: list[int]) -> None:
        for b in ids:
            if self.refs[b] == 0:
                del self.free[b]
            self.refs[b] += 1


def _storm(pool: BlockPool, rng: random.Random, steps: int, old: PreviousFreeQueue | None) -> None:
    """Random requests: allocate a chain, register it (each block's parent the one before),
    touch cached chains, free tail first (sometimes to the front), drop hashes now and then."""
    owned: list[list[BlockId]] = []
    chains: list[list[tuple[BlockHash, list[int]]]] = []
    for step in range(steps):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            got = pool.allocate(n)
            if old is not None:
                assert got == old.allocate(n), f"step {step}: lru chose other blocks"
            chain = [(BlockHash(rng.randbytes(4)), [rng.randrange(99)]) for _ in got]
            parent = None
            for blk, (h, tokens) in zip(got, chain, strict=True):
                pool.register(blk, h, tokens, parent)
                parent = h
            owned.append(got)
            chains.append(chain)
        elif op < 0.6 and chains:
            chain = rng.choice(chains)
            hit: list[BlockId] = []
            for h, tokens in chain:  # a prefix hit stops at the first block gone
                found = pool.lookup(h, tokens)
                if found is None:
                    break
                hit.append(found)
            pool.touch(hit)
            if old is not None:
                old.touch([int(b) for b in hit])
            owned.append(hit)
        elif op < 0.95 and owned:
            ids = owned.pop(rng.randrange(len(owned)))
            first = rng.random() < 0.2
            pool.free(list(reversed(ids)), evict_first=first)
            if old is not None:
                old.free_blocks([int(b) for b in reversed(ids)], first)
        elif owned:
            pool.unregister(rng.choice(owned))
            if rng.random() < 0.5:  # a free block's hash dropped too: it stays free
                pool.unregister([BlockId(rng.randrange(pool.num_blocks))])
        in_use = {b for ids in owned for b in ids}
        assert pool.num_free + len(in_use) == pool.num_blocks
    pool.check_integrity()
    for ids in owned:
        pool.free(list(reversed(ids)))
    assert pool.num_free == pool.num_blocks
    pool.check_integrity()


@pytest.mark.parametrize("seed", range(5))
def test_lru_hands_out_the_blocks_the_previous_queue_did(seed: int) -> None:
    pool = BlockPool(24, policy="lru")
    _storm(pool, random.Random(seed), 600, PreviousFreeQueue(24))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_no_block_leaks_through_eviction_storms(name: str) -> None:
    pool = BlockPool(32, policy=name)
    evicted: list[BlockHash] = []
    pool.on_evict = lambda blk, h, tokens, parent: evicted.append(h)
    _storm(pool, random.Random(name), 3000, None)
    assert evicted  # the storm did evict cached blocks
    cached = pool.num_cached
    assert pool.reset_cache() == cached and pool.num_cached == 0  # every block was free


def test_the_lru_check_can_fail() -> None:
    """Another policy hands out other blocks than the previous queue on the same storm."""
    with pytest.raises(AssertionError, match="lru chose other blocks"):
        _storm(BlockPool(24, policy="slru"), random.Random(0), 600, PreviousFreeQueue(24))


def _machine_for(policy: str) -> type[PoolMachine]:
    """The pool's state machine (refs, hashes, a hook that sometimes raises) over `policy`."""

    class Machine(PoolMachine):
        def __init__(self) -> None:
            super().__init__()
            self.pool = BlockPool(8, policy=policy)
            self.pool.on_evict = self._hook

    Machine.__name__ = f"PoolMachine_{policy}"
    return Machine


_STATEFUL = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestSlruPoolMachine = _machine_for("slru").TestCase
TestSlruPoolMachine.settings = _STATEFUL
TestS3FifoPoolMachine = _machine_for("s3fifo").TestCase
TestS3FifoPoolMachine.settings = _STATEFUL
TestLeafLruPoolMachine = _machine_for("leaf_lru").TestCase
TestLeafLruPoolMachine.settings = _STATEFUL
TestFanoutLruPoolMachine = _machine_for("fanout_lru").TestCase
TestFanoutLruPoolMachine.settings = _STATEFUL
