"""The device pool under retention and tenant quotas: victims by retention class first, a
tenant's budget trims only its own retentions, expiry and closed sessions return blocks to
the default class, and the eviction hook still reads a leaving block's retention and owner."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.quotas import TenantQuota
from cachesvc.kv.retention import LONG, SHORT, Retention
from cachesvc.kv.types import BlockHash, BlockId

NUM = 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _cached(pool: BlockPool, tenant: str, tags: list[bytes]) -> list[BlockId]:
    """Register one block per tag for `tenant` and give them back (cached, free)."""
    ids = pool.allocate(len(tags))
    for blk, tag in zip(ids, tags, strict=True):
        assert pool.register(blk, BlockHash(tag), [int(blk)], tenant=tenant)
    return ids


def test_retained_blocks_go_after_every_unretained_one() -> None:
    clock = Clock()
    pool = BlockPool(4, clock=clock)
    a, b, c, d = _cached(pool, "t", [b"a", b"b", b"c", b"d"])
    assert pool.retain([a], Retention(LONG, clock.now + 60, "t")) == 0
    assert pool.retain([b], Retention(SHORT, clock.now + 60, "t")) == 0
    pool.free([a, b, c, d])  # a is the least recently freed
    assert pool.allocate(2) == [c, d]
    assert pool.allocate(1) == [b]  # the short class before the long one
    pool.check_integrity()


def test_an_expired_retention_returns_its_block_to_the_default_class() -> None:
    clock = Clock()
    pool = BlockPool(2, clock=clock)
    a, b = _cached(pool, "t", [b"a", b"b"])
    pool.retain([a], Retention(SHORT, clock.now + 5, "t"))
    pool.free([a, b])
    clock.now += 10
    assert pool.retention_of(a) is None
    # Back in the default class as just used (the class order keeps no older place).
    assert pool.allocate(2) == [b, a]
    pool.check_integrity()


def test_the_eviction_hook_reads_the_leaving_blocks_retention_and_owner() -> None:
    clock = Clock()
    pool = BlockPool(2, clock=clock)  # a tenant may retain half the pool by default: 1 block
    [a] = _cached(pool, "alice", [b"a"])
    keep = Retention(SHORT, clock.now + 60, "alice", "s")
    assert pool.retain([a], keep) == 0
    pool.free([a])
    seen = []
    pool.on_evict = lambda blk, *_: seen.append((pool.retention_of(blk), pool.tenant_of(blk)))
    pool.allocate(2)
    assert seen == [(keep, "alice")]
    assert pool.retention_of(a) is None and pool.tenant_of(a) is None  # gone after the hook


def test_a_budget_trims_the_tenants_own_oldest_retention_only() -> None:
    clock = Clock()
    pool = BlockPool(8, clock=clock)
    pool.set_quotas({"a": TenantQuota(retention_share=0.25), "b": TenantQuota()})
    blocks = _cached(pool, "a", [b"1", b"2", b"3"]) + _cached(pool, "b", [b"4"])
    a1, a2, a3, b1 = blocks
    pool.retain([b1], Retention(SHORT, clock.now + 60, "b"))
    pool.retain([a1], Retention(SHORT, clock.now + 60, "a"))
    assert pool.retain([a2, a3], Retention(SHORT, clock.now + 60, "a")) == 0
    # A budget of 2 blocks: a1, the oldest, is no longer retained; b's never touched.
    assert [pool.retention_of(x) is not None for x in blocks] == [False, True, True, True]
    # One request past the budget on its own keeps its head: its tail is trimmed.
    more = _cached(pool, "a", [b"5", b"6", b"7"])
    assert pool.retain(more, Retention(SHORT, clock.now + 60, "a")) == 1
    assert [pool.retention_of(x) is not None for x in more] == [True, True, False]
    pool.check_integrity()


def test_closing_a_session_ends_its_retentions_only() -> None:
    clock = Clock()
    pool = BlockPool(8, clock=clock)  # a budget of 4 blocks
    a, b, c = _cached(pool, "t", [b"a", b"b", b"c"])
    pool.retain([a, b], Retention(SHORT, clock.now + 60, "t", "s1"))
    pool.retain([c], Retention(SHORT, clock.now + 60, "t", "s2"))
    assert pool.close_session("t", "s1") == 2
    assert pool.close_session("other", "s2") == 0
    assert [pool.retention_of(x) is not None for x in (a, b, c)] == [False, False, True]
    assert pool.tenant_blocks()["t"].retained == 1


def test_with_quotas_a_tenant_over_its_share_is_evicted_first() -> None:
    pool = BlockPool(8)
    pool.set_quotas({"a": TenantQuota(share=0.5), "b": TenantQuota(share=0.5)})
    old = _cached(pool, "a", [b"a1", b"a2"])
    pool.free(old)  # alice's: the least recently freed
    newer = _cached(pool, "b", [b"b1", b"b2", b"b3", b"b4", b"b5", b"b6"])
    pool.free(newer)
    # LRU would take alice's two; bob holds 6 for a share of 4.
    assert pool.allocate(2) == newer[:2]
    pool.free(pool.allocate(0))
    # Bob at his share, taking 2 more, makes room from his own; alice taking 2 does not.
    assert pool.allocate(2, tenant="b") == newer[2:4]
    assert pool.allocate(2, tenant="a") == old
    pool.check_integrity()


def test_retained_blocks_are_bounded_by_the_budget_not_the_share() -> None:
    clock = Clock()
    pool = BlockPool(8, clock=clock)
    pool.set_quotas({"a": TenantQuota(share=0.25, retention_share=0.5)})
    kept = _cached(pool, "a", [b"1", b"2", b"3"])
    pool.retain(kept, Retention(SHORT, clock.now + 60, "a"))
    pool.free(kept)
    rest = pool.allocate(5)  # the empty blocks
    pool.free(rest)
    # Alice is over her share, but only with retained blocks: the empty blocks go first.
    assert sorted(pool.allocate(5, tenant="a")) == sorted(rest)
    pool.check_integrity()


class RetentionMachine(RuleBasedStateMachine):
    """Random use of a small pool by two tenants with retentions, quotas, sessions and time;
    after every evicting allocation, no evictable cached block of a lower class was left."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.pool = BlockPool(NUM, clock=self.clock)
        self.refs: dict[int, int] = {}
        self.evicted_classes: list[int] = []
        self.pool.on_evict = self._hook
        self.tag = 0

    def _hook(self, blk: BlockId, *_: object) -> None:
        retention = self.pool.retention_of(blk)
        self.evicted_classes.append(0 if retention is None else retention.cls)

    def _free_classes(self) -> list[int]:
        out = []
        for i in range(NUM):
            blk = BlockId(i)
            if i not in self.refs and self.pool.block_hash(blk) is not None:
                retention = self.pool.retention_of(blk)
                out.append(0 if retention is None else retention.cls)
        return out

    @rule(n=st.integers(1, 3))
    def allocate(self, n: int) -> None:
        if n > NUM - len(self.refs):
            return
        before = sorted(self._free_classes())
        self.evicted_classes = []
        got = self.pool.allocate(n)
        for blk in got:
            self.refs[blk] = 1
        if self.evicted_classes:
            # Each victim's class is among the lowest the free cached blocks had.
            assert max(self.evicted_classes) <= before[len(self.evicted_classes) - 1]

    @precondition(lambda self: self.refs)
    @rule(data=st.data(), tenant=st.sampled_from(["a", "b"]))
    def register(self, data: st.DataObject, tenant: str) -> None:
        blk = data.draw(st.sampled_from(sorted(self.refs)))
        self.tag += 1
        self.pool.register(
            BlockId(blk), BlockHash(self.tag.to_bytes(4, "big")), [blk], None, tenant
        )

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def free_one(self, data: st.DataObject) -> None:
        blk = data.draw(st.sampled_from(sorted(self.refs)))
        self.pool.free([BlockId(blk)])
        self.refs[blk] -= 1
        if not self.refs[blk]:
            del self.refs[blk]

    @rule(
        blocks=st.lists(st.integers(0, NUM - 1), min_size=1, max_size=4, unique=True),
        cls=st.sampled_from([SHORT, LONG]),
        ttl=st.integers(1, 20),
        tenant=st.sampled_from(["a", "b"]),
        session=st.sampled_from([None, "s"]),
    )
    def retain(
        self, blocks: list[int], cls: int, ttl: int, tenant: str, session: str | None
    ) -> None:
        retention = Retention(cls, self.clock.now + ttl, tenant, session)
        self.pool.retain([BlockId(b) for b in blocks], retention)

    @rule(seconds=st.integers(0, 15))
    def advance(self, seconds: int) -> None:
        self.clock.now += seconds

    @rule(share=st.sampled_from([0.25, 0.5, 1.0]), budget=st.sampled_from([0.0, 0.25, 1.0]))
    def quotas(self, share: float, budget: float) -> None:
        self.pool.set_quotas({"a": TenantQuota(share, budget)})

    @rule(tenant=st.sampled_from(["a", "b"]))
    def close(self, tenant: str) -> None:
        self.pool.close_session(tenant, "s")

    @invariant()
    def whole(self) -> None:
        self.pool.check_integrity()


TestRetentionMachine = RetentionMachine.TestCase
TestRetentionMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
