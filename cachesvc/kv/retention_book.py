"""The eviction order of one store under retention and tenant quotas (`RetentionBook`).

A store (a tier's blocks; the device pool's could be keyed the same way) tells the book what it
holds, how big each entry is in the store's own units (a slot, a byte), whose it is and its
retention; the book answers the victims in order:

1. blocks of tenants over their soft share (`TenantQuota.share` x capacity), the tenant most
   over first, each tenant's in its own retention order;
2. then every block in retention order (`ClassedPolicy`): unretained first, lower classes
   before higher ones, the configured policy within a class.

A retention ends lazily when a question is asked after its expiry (wall clock, the injectable
`clock`): its block returns to class 0. Past a tenant's retention budget
(`TenantQuota.retention_share` x capacity) its own oldest retention is demoted to class 0,
never another tenant's. The book never evicts anything itself: the store does, and says so
(`remove`). A store whose keys are also in use (the device pool's blocks) `pull`s a key while it
is used and `push`es it back when it is evictable again: it counts all the while, but is no
victim. Not thread-safe: the store calls it under its own lock.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from cachesvc.kv.eviction.classes import ClassedPolicy
from cachesvc.kv.quotas import TenantBlocks, TenantQuota
from cachesvc.kv.retention import NO_RETENTION, NUM_CLASSES, Retention

K = TypeVar("K", bound=Hashable)
NO_QUOTA = TenantQuota(share=1.0, retention_share=1.0)


@dataclass
class _Entry:
    size: int
    tenant: str  # whose block it is (the soft share)
    retention: Retention | None  # counts against `retention.tenant`'s budget


class RetentionBook(Generic[K]):
    """Held keys of one store of `capacity` units, ordered by `policy` within retention
    classes. `on_change(key, retention)` is called whenever a held key's retention changes
    (None: it ended), for a store that persists it."""

    def __init__(
        self,
        policy: str,
        capacity: int,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[K, Retention | None], None] | None = None,
    ) -> None:
        self.policy = policy
        self.capacity = capacity
        self.clock = clock
        self.on_change = on_change
        self.quotas: dict[str, TenantQuota] = {}
        self.default_quota = TenantQuota()  # a tenant's not named in `quotas`
        self._entries: dict[K, _Entry] = {}
        self._order: ClassedPolicy[K] = ClassedPolicy(policy, NUM_CLASSES)
        self._by_tenant: dict[str, ClassedPolicy[K]] = {}  # the same order, per owner
        self._used: dict[str, int] = {}  # units per owner
        self._retained: dict[str, OrderedDict[K, None]] = {}  # per retention tenant, oldest first
        self._retained_units: dict[str, int] = {}
        self._expiries: list[tuple[float, int, K]] = []  # a heap; stale entries skipped
        self._in_use: set[K] = set()  # held keys pulled out of the order
        self._seq = 0

    # ---- what the store tells ---------------------------------------------------------------

    def add(
        self,
        key: K,
        size: int,
        parent: K | None = None,
        retention: Retention | None = None,
        tenant: str | None = None,
    ) -> None:
        """A new key, as just used. `tenant`: its owner (default: its retention's, else "")."""
        assert key not in self._entries and size > 0, "added twice, or empty"
        owner = tenant if tenant is not None else (retention.tenant if retention else "")
        self._entries[key] = _Entry(size, owner, None)
        self._used[owner] = self._used.get(owner, 0) + size
        mine = self._by_tenant.get(owner)
        if mine is None:
            mine = self._by_tenant[owner] = ClassedPolicy(self.policy, NUM_CLASSES)
        self._order.push(key, parent)
        mine.push(key, parent)
        if retention is not None:
            self.retain(key, retention)

    def use(self, key: K, parent: K | None = None) -> None:
        """A hit on a held key: one more use, for the policy (a key in use stays so)."""
        entry = self._entries[key]
        for order in (self._order, self._by_tenant[entry.tenant]):
            order.pull(key)
            if key not in self._in_use:
                order.push(key, parent)

    def pull(self, key: K) -> None:
        """A held key is in use: no victim until `push`; the use counts for the policy."""
        self._in_use.add(key)
        self._order.pull(key)
        self._by_tenant[self._entries[key].tenant].pull(key)

    def push(self, key: K, parent: K | None = None) -> None:
        """A held key in use is evictable again, as just used."""
        self._in_use.discard(key)
        self._order.push(key, parent)
        self._by_tenant[self._entries[key].tenant].push(key, parent)

    def retain(self, key: K, retention: Retention) -> None:
        """Retain a held key (merged with a retention it has); an expired one is ignored.
        Trims the retention tenant's oldest retentions past its budget."""
        if retention.expired(self.clock()):
            return
        entry = self._entries[key]
        old = entry.retention
        new = retention if old is None else old.merge(retention)
        if old is not None:
            self._unretain(key, entry, notify=False)
        self._set(key, entry, new)
        self._trim(new.tenant)

    def remove(self, key: K) -> None:
        """The key left the store (evicted, moved down, removed); unknown keys are ignored."""
        entry = self._entries.get(key)
        if entry is None:
            return
        if entry.retention is not None:
            self._unretain(key, entry, notify=True)
        del self._entries[key]
        self._in_use.discard(key)
        self._used[entry.tenant] -= entry.size
        if not self._used[entry.tenant]:
            del self._used[entry.tenant]
        self._order.discard(key)
        if entry.tenant not in self._used:  # its owner's last key
            del self._by_tenant[entry.tenant]
        else:
            self._by_tenant[entry.tenant].discard(key)

    def set_quotas(self, quotas: Mapping[str, TenantQuota]) -> None:
        """Tenants' quotas from now on (a tenant not named has `TenantQuota()`'s); trims
        retentions past a budget that shrank."""
        self.quotas = dict(quotas)
        for tenant in list(self._retained):
            self._trim(tenant)

    def end_session(self, tenant: str, session: str) -> list[K]:
        """End the retentions of `tenant`'s `session`: their keys return to class 0."""
        ended = [k for k in self._retained.get(tenant, ()) if self._retention(k).session == session]
        for k in ended:
            self._unretain(k, self._entries[k], notify=True)
        return ended

    # ---- what the store asks ----------------------------------------------------------------

    def victims(self, limit: int) -> list[K]:
        """Up to `limit` held keys, the next victim first (see the module's docstring)."""
        self.expire()
        out: dict[K, None] = {}
        for tenant in self._over_share():
            for k in self._by_tenant[tenant].peek(limit - len(out)):
                out[k] = None
            if len(out) >= limit:
                return list(out)
        for k in self._order.peek(limit + len(out)):  # some are out already
            if len(out) >= limit:
                break
            out[k] = None
        return list(out)

    @property
    def has_quotas(self) -> bool:
        """Whether any tenant's soft share is below the whole store."""
        return any(q.share < 1.0 for q in self.quotas.values())

    def quota_victim(self, tenant: str | None = None, extra: int = 0) -> K | None:
        """For a store that orders its own victims (the device pool): the next unretained key
        of the tenant most over its soft share, `tenant` counted with `extra` more units (what
        it is taking now: a tenant at its share makes room from its own blocks first). None
        when no tenant over its share has an unretained evictable key: retained keys are
        bounded by the retention budget, not by the share."""
        over: dict[str, float] = {}
        for t, used in self._used.items():
            share = self._quota(t).share
            if share < 1.0:
                excess = used + (extra if t == tenant else 0) - share * self.capacity
                if excess > 0:
                    over[t] = excess
        if tenant is not None and tenant not in self._used and extra:
            share = self._quota(tenant).share
            if share < 1.0 and extra > share * self.capacity:
                over[tenant] = extra - share * self.capacity
        for t in sorted(over, key=lambda t: -over[t]):
            mine = self._by_tenant.get(t)
            if mine is not None and mine.lowest_class() == NO_RETENTION:
                return mine.peek(1)[0]
        return None

    def retention_of(self, key: K) -> Retention | None:
        """The key's retention, None when it has none or it expired (then it ends)."""
        entry = self._entries.get(key)
        if entry is None or entry.retention is None:
            return None
        if entry.retention.expired(self.clock()):
            self._unretain(key, entry, notify=True)
            return None
        return entry.retention

    def outranks(self, key: K, retention: Retention | None) -> bool:
        """Whether held `key` should stay rather than make room for a newcomer of `retention`
        (None: unretained): its class is higher, and its owner is within its share. A store
        full of such keys sends the newcomer elsewhere (a tier below) rather than evict them."""
        mine = self.retention_of(key)
        theirs = 0 if retention is None or retention.expired(self.clock()) else retention.cls
        if mine is None or mine.cls <= theirs:
            return False
        return self._entries[key].tenant not in self._over_share()

    def tenant_of(self, key: K) -> str:
        return self._entries[key].tenant

    def retained(self) -> dict[K, Retention]:
        """Every unexpired retention, by key."""
        self.expire()
        return {k: self._retention(k) for keys in self._retained.values() for k in keys}

    @property
    def num_retained(self) -> int:
        """How many keys are retained (expired ones until asked)."""
        return sum(len(keys) for keys in self._retained.values())

    def tenant_blocks(self) -> dict[str, TenantBlocks]:
        """Each tenant's held keys (by owner) and retained ones (by retention tenant)."""
        self.expire()
        cached: dict[str, int] = {}
        for entry in self._entries.values():
            cached[entry.tenant] = cached.get(entry.tenant, 0) + 1
        tenants = set(cached) | set(self._retained)
        return {t: TenantBlocks(cached.get(t, 0), len(self._retained.get(t, ()))) for t in tenants}

    def expire(self) -> int:
        """End every retention past its expiry; returns how many ended."""
        now, n = self.clock(), 0
        while self._expiries and self._expiries[0][0] <= now:
            _, _, key = heapq.heappop(self._expiries)
            entry = self._entries.get(key)
            if entry is not None and entry.retention is not None and entry.retention.expired(now):
                self._unretain(key, entry, notify=True)
                n += 1
        return n

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[K]:
        """Held keys: the evictable ones in retention order (quotas aside), the next victim
        first, then those in use."""
        yield from self._order
        yield from self._in_use

    # ---- inside -----------------------------------------------------------------------------

    def _quota(self, tenant: str) -> TenantQuota:
        return self.quotas.get(tenant, self.default_quota)

    def _over_share(self) -> list[str]:
        """Owners over their soft share, the most over (in units) first."""
        over = {t: u - self._quota(t).share * self.capacity for t, u in self._used.items()}
        return sorted((t for t, o in over.items() if o > 0), key=lambda t: -over[t])

    def _retention(self, key: K) -> Retention:
        retention = self._entries[key].retention
        assert retention is not None
        return retention

    def _set(self, key: K, entry: _Entry, retention: Retention) -> None:
        entry.retention = retention
        tenant = retention.tenant
        self._retained.setdefault(tenant, OrderedDict())[key] = None
        self._retained_units[tenant] = self._retained_units.get(tenant, 0) + entry.size
        self._order.set_class(key, retention.cls)
        self._by_tenant[entry.tenant].set_class(key, retention.cls)
        self._seq += 1
        heapq.heappush(self._expiries, (retention.expires_at, self._seq, key))
        if len(self._expiries) > 2 * len(self._entries) + 64:
            self._compact_expiries()
        if self.on_change is not None:
            self.on_change(key, retention)

    def _unretain(self, key: K, entry: _Entry, notify: bool) -> None:
        """End the key's retention: back to class 0 (the order starts afresh there)."""
        assert entry.retention is not None
        tenant = entry.retention.tenant
        entry.retention = None
        keys = self._retained[tenant]
        del keys[key]
        self._retained_units[tenant] -= entry.size
        if not keys:
            del self._retained[tenant], self._retained_units[tenant]
        self._order.set_class(key, NO_RETENTION)
        self._by_tenant[entry.tenant].set_class(key, NO_RETENTION)
        if notify and self.on_change is not None:
            self.on_change(key, None)

    def _trim(self, tenant: str) -> None:
        """Demote `tenant`'s oldest retentions while it is past its budget."""
        budget = self._quota(tenant).retention_share * self.capacity
        while self._retained_units.get(tenant, 0) > budget:
            oldest = next(iter(self._retained[tenant]))
            self._unretain(oldest, self._entries[oldest], notify=True)

    def _compact_expiries(self) -> None:
        live = [
            (e.retention.expires_at, i, k)
            for i, (k, e) in enumerate(self._entries.items())
            if e.retention is not None
        ]
        heapq.heapify(live)
        self._expiries, self._seq = live, len(live)

    def check_integrity(self) -> None:
        """Raise AssertionError if the counts or orders disagree with the entries."""
        self._order.check_integrity()
        assert set(self._order) == set(self._entries) - self._in_use, "order and entries disagree"
        assert self._in_use <= set(self._entries)
        used: dict[str, int] = {}
        retained: dict[str, int] = {}
        for k, e in self._entries.items():
            used[e.tenant] = used.get(e.tenant, 0) + e.size
            evictable = k in self._by_tenant[e.tenant]
            assert evictable != (k in self._in_use), "a key missing from its owner's order"
            cls = e.retention.cls if e.retention else NO_RETENTION
            assert self._order.class_of(k) == cls, "a key in the wrong class"
            if e.retention is not None:
                t = e.retention.tenant
                retained[t] = retained.get(t, 0) + e.size
                assert k in self._retained[t], "a retained key missing from its tenant's"
        assert used == self._used and retained == self._retained_units
        num_evictable = len(self._entries) - len(self._in_use)
        assert sum(len(o) for o in self._by_tenant.values()) == num_evictable
