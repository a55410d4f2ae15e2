"""A Hypothesis state machine over the TierManager with retention: random device evictions
(retained or not, expired or not), quotas and session closes. After every step the manager
agrees with its tiers (their retention books included), no tenant holds more retained blocks in
a tier than its budget, and every retention a tier holds is one the block was given."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import test_tier_manager as tm
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cachesvc.kv.quotas import TenantQuota
from cachesvc.kv.retention import LONG, SHORT, Retention
from cachesvc.kv.types import BlockHash

TENANTS = ["a", "b"]


class RetainedTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp())
        self.device: dict[BlockHash, BlockHash | None] = {}
        self.m = tm.manager(self.dir, dram_slots=3, nvme_blocks=4, device=self.device)  # type: ignore[arg-type]
        self.given: dict[BlockHash, set[tuple[str, str | None]]] = {}
        self.quotas: dict[str, TenantQuota] = {}

    @rule(chain=st.integers(0, 2), n=st.integers(1, 7))
    def compute(self, chain: int, n: int) -> None:
        for h in tm.CHAINS[chain][:n]:
            self.device[h] = tm.PARENT[h]

    @rule(
        data=st.data(),
        cls=st.sampled_from([0, SHORT, LONG]),
        tenant=st.sampled_from(TENANTS),
        session=st.sampled_from([None, "s"]),
        expired=st.booleans(),
    )
    def evict_from_device(
        self, data: st.DataObject, cls: int, tenant: str, session: str | None, expired: bool
    ) -> None:
        if not self.device:
            return
        h = data.draw(st.sampled_from(sorted(self.device)))
        retention = None
        if cls:
            expires_at = time.time() + (-1 if expired else 3600)
            retention = Retention(cls, expires_at, tenant, session)
            self.given.setdefault(h, set()).add((tenant, session))
        self.m.demote(tm.block(h), retention)
        del self.device[h]

    @rule(shares=st.dictionaries(st.sampled_from(TENANTS), st.floats(0, 1), max_size=2))
    def set_quotas(self, shares: dict[str, float]) -> None:
        self.quotas = {t: TenantQuota(share=1.0, retention_share=r) for t, r in shares.items()}
        self.m.set_quotas(self.quotas)

    @rule(tenant=st.sampled_from(TENANTS))
    def close_session(self, tenant: str) -> None:
        self.m.close_session(tenant, "s")
        for tier in self.m.local:
            for h in tier.entries():
                r = tier.retention_of(h)
                assert r is None or (r.tenant, r.session) != (tenant, "s")

    @invariant()
    def consistent(self) -> None:
        self.m.check_integrity()
        for tier in self.m.local:
            units: dict[str, int] = {}  # retained slots (DRAM) or bytes (NVMe) per tenant
            for h in tier.entries():
                r = tier.retention_of(h)
                if r is None:
                    continue
                assert (r.tenant, r.session) in self.given.get(h, set())
                units[r.tenant] = units.get(r.tenant, 0) + self._size(tier.name, h)
            capacity = self._size(tier.name, None)
            for tenant, n in units.items():
                budget = self.quotas.get(tenant, TenantQuota()).retention_share * capacity
                assert n <= budget, f"{tenant} over its retention budget in {tier.name}"

    def _size(self, tier: str, h: BlockHash | None) -> int:
        """A block's size in the tier's units (the tier's capacity for None)."""
        if tier == "dram":
            return 1 if h is not None else self.m.tier("dram").num_slots  # type: ignore[attr-defined]
        nvme = self.m.tier("nvme")
        if h is None:
            return nvme.capacity_bytes  # type: ignore[attr-defined,no-any-return]
        nvme.flush()  # type: ignore[attr-defined]
        return (self.dir / tm.file_name(h, tm.PARENT[h])).stat().st_size

    def teardown(self) -> None:
        self.m.close()
        shutil.rmtree(self.dir, ignore_errors=True)


RetainedTierMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None
)
test_retained_tier_machine = RetainedTierMachine.TestCase
