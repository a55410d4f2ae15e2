"""RetentionBook: victims in retention order (unretained, then lower classes), tenants over their
share first, retention budgets trimmed within the tenant, lazy expiry; and a Hypothesis state
machine checking its invariants against a plain model under random operations."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import LONG, SHORT, Retention
from cachesvc.kv.retention_book import RetentionBook

T0 = 100.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def test_victims_come_unretained_first_then_by_class() -> None:
    book: RetentionBook[int] = RetentionBook("lru", 10, Clock())
    book.set_quotas({"a": TenantQuota(retention_share=1.0)})
    book.add(1, 1, retention=Retention(LONG, T0 + 50, "a"))
    book.add(2, 1, retention=Retention(SHORT, T0 + 50, "a"))
    book.add(3, 1)
    book.add(4, 1)
    book.use(3)
    assert book.victims(10) == [4, 3, 2, 1]
    book.check_integrity()


def test_expiry_is_lazy_and_on_the_wall_clock() -> None:
    changes: list[tuple[int, Retention | None]] = []
    clock = Clock()
    book: RetentionBook[int] = RetentionBook(
        "lru", 10, clock, on_change=lambda k, r: changes.append((k, r))
    )
    book.add(1, 1, retention=Retention(SHORT, T0 + 5, "a"))
    book.add(2, 1)
    assert book.victims(1) == [2]
    clock.now = T0 + 5
    assert book.victims(2) == [2, 1]  # back in class 0, as just used there
    assert changes == [(1, Retention(SHORT, T0 + 5, "a")), (1, None)]
    book.retain(2, Retention(SHORT, T0 + 1, "a"))  # expired already: ignored
    assert book.retention_of(2) is None and book.num_retained == 0


def test_merge_keeps_the_stronger_claim() -> None:
    book: RetentionBook[int] = RetentionBook("lru", 10, Clock())
    book.add(1, 1, retention=Retention(LONG, T0 + 10, "a"))
    book.retain(1, Retention(SHORT, T0 + 50, "b", "s"))
    assert book.retention_of(1) == Retention(LONG, T0 + 50, "b", "s")
    assert book.tenant_blocks() == {"a": TenantBlocks(1, 0), "b": TenantBlocks(0, 1)}
    book.check_integrity()


def test_budget_counts_units_and_trims_the_oldest_retention() -> None:
    book: RetentionBook[str] = RetentionBook("lru", 100, Clock())
    book.set_quotas({"a": TenantQuota(retention_share=0.5)})  # 50 units
    book.add("x", 30, retention=Retention(SHORT, T0 + 50, "a"))
    book.add("y", 10, retention=Retention(SHORT, T0 + 50, "a"))
    book.add("z", 20, retention=Retention(SHORT, T0 + 50, "a"))
    assert [k for k in "xyz" if book.retention_of(k)] == ["y", "z"]
    book.add("w", 10, retention=Retention(SHORT, T0 + 50, "b"))  # b's budget: its own
    assert [k for k in "xyzw" if book.retention_of(k)] == ["y", "z", "w"]


def test_over_share_tenants_first_most_over_first() -> None:
    book: RetentionBook[int] = RetentionBook("lru", 10, Clock())
    book.set_quotas({"a": TenantQuota(share=0.2), "b": TenantQuota(share=0.3)})
    for k in range(3):
        book.add(k, 1, tenant="c")
    for k in range(10, 13):  # a: 1 over
        book.add(k, 1, tenant="a")
    for k in range(20, 25):  # b: 2 over
        book.add(k, 1, tenant="b", retention=Retention(LONG, T0 + 9, "b"))
    assert book.victims(10) == [20, 21, 22, 23, 24, 10, 11, 12, 0, 1]
    assert book.outranks(20, None) is False  # b is over its share: its class does not count
    book.set_quotas({})
    assert book.victims(4) == [0, 1, 2, 10] and book.outranks(20, None)
    assert not book.outranks(20, Retention(LONG, T0 + 1, "c"))


def test_end_session_ends_only_that_tenants_session() -> None:
    book: RetentionBook[int] = RetentionBook("lru", 10, Clock())
    book.add(1, 1, retention=Retention(SHORT, T0 + 9, "a", "s"))
    book.add(2, 1, retention=Retention(SHORT, T0 + 9, "a", "t"))
    book.add(3, 1, retention=Retention(SHORT, T0 + 9, "b", "s"))
    assert book.end_session("a", "s") == [1]
    assert [k for k in (1, 2, 3) if book.retention_of(k)] == [2, 3]


def test_a_key_in_use_counts_but_is_no_victim() -> None:
    book: RetentionBook[int] = RetentionBook("lru", 4, Clock())
    book.set_quotas({"a": TenantQuota(share=0.25, retention_share=0.5)})
    book.add(1, 1, tenant="a")
    book.add(2, 1, tenant="a")
    book.add(3, 1, retention=Retention(SHORT, T0 + 9, "b"))
    book.pull(1)
    book.use(1)  # a hit while in use: still in use
    assert book.victims(4) == [2, 3]
    assert set(book) == {1, 2, 3} and book.tenant_blocks()["a"] == TenantBlocks(2, 0)
    book.push(1)
    assert book.victims(4) == [2, 1, 3]
    book.pull(3)
    book.remove(3)
    book.check_integrity()


class BookMachine(RuleBasedStateMachine):
    """Random adds, uses, retentions, removals, quotas and time against a model of the keys."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.book: RetentionBook[int] = RetentionBook("lru", 12, self.clock)
        self.sizes: dict[int, int] = {}
        self.in_use: set[int] = set()

    keys = st.integers(0, 15)
    tenants = st.sampled_from(["a", "b", "c"])
    retentions = st.builds(
        Retention,
        st.sampled_from([SHORT, LONG]),
        st.floats(T0, T0 + 20),
        tenants,
        st.sampled_from([None, "s"]),
    )

    @rule(key=keys, size=st.integers(1, 3), r=st.none() | retentions, tenant=st.none() | tenants)
    def add(self, key: int, size: int, r: Retention | None, tenant: str | None) -> None:
        if key in self.sizes:
            self.book.use(key)
            if r is not None:
                self.book.retain(key, r)
            return
        self.book.add(key, size, None, r, tenant)
        self.sizes[key] = size

    @rule(key=keys)
    def pull_or_push(self, key: int) -> None:
        if key not in self.sizes:
            return
        if key in self.in_use:
            self.book.push(key)
            self.in_use.discard(key)
        else:
            self.book.pull(key)
            self.in_use.add(key)

    @rule(key=keys)
    def remove(self, key: int) -> None:
        self.in_use.discard(key)
        self.book.remove(key)
        self.sizes.pop(key, None)

    @rule(shares=st.dictionaries(tenants, st.tuples(st.floats(0, 1), st.floats(0, 1))))
    def quotas(self, shares: dict[str, tuple[float, float]]) -> None:
        self.book.set_quotas({t: TenantQuota(s, r) for t, (s, r) in shares.items()})

    @rule(seconds=st.floats(0, 10))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(tenant=tenants)
    def end_session(self, tenant: str) -> None:
        self.book.end_session(tenant, "s")
        assert all(r.tenant != tenant or r.session != "s" for r in self.book.retained().values())

    @invariant()
    def consistent(self) -> None:
        book = self.book
        book.check_integrity()
        assert set(book) == set(self.sizes)
        retained = book.retained()
        assert all(not r.expired(self.clock.now) for r in retained.values())
        for tenant in {r.tenant for r in retained.values()}:
            units = sum(self.sizes[k] for k, r in retained.items() if r.tenant == tenant)
            quota = book.quotas.get(tenant, TenantQuota())
            assert units <= quota.retention_share * book.capacity
        victims = book.victims(len(self.sizes))
        assert sorted(victims) == sorted(set(self.sizes) - self.in_use)
        if not any(
            sum(s for k, s in self.sizes.items() if book.tenant_of(k) == t)
            > book.quotas.get(t, TenantQuota()).share * book.capacity
            for t in {book.tenant_of(k) for k in self.sizes}
        ):
            classes = [r.cls if (r := retained.get(k)) else 0 for k in victims]
            assert classes == sorted(classes), "a retained key offered before a lower class"


TestBookMachine = BookMachine.TestCase
TestBookMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
