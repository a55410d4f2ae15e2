"""TierManager: demotion DRAM -> NVMe -> dropped, leaf-first victims, no orphaned suffix,
lookups over mixed tiers, corrupt blobs settled as misses, sharing after N reuses, events that
mirror the tiers; and a Hypothesis state machine over all of it."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path

import numpy as np
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cachesvc.kv.codec import Codec, KVBlock
from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, EventLog
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.tiers.dram import DramTier
from cachesvc.kv.tiers.nvme import NvmeTier, file_name
from cachesvc.kv.tiers.redis_tier import RedisTier
from cachesvc.kv.tiers.results import FetchResult, TierHit
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockHash

FP = "ab" * 16
CODECS = {n: Codec(FP, "raw" if n == "dram" else "shuffle_lz4") for n in ("dram", "nvme", "redis")}
ROOT = root_hash(FP, 2)
# Three chains sharing prefixes: 0 and 1 share 3 blocks, 0 and 2 share 1.
_TOKENS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
    [1, 2, 3, 4, 5, 6, 0, 0, 9, 9],
    [1, 2, 7, 7, 7, 7, 8, 8],
]
CHAINS = [hash_blocks(t, 2, ROOT) for t in _TOKENS]
PARENT = {h: (c[i - 1] if i else None) for c in CHAINS for i, h in enumerate(c)}


def block(h: BlockHash) -> KVBlock:
    """A tiny block whose KV is derived from its hash, so a read back can be checked."""
    return KVBlock(h, PARENT.get(h), "float32", np.frombuffer(h, np.float32).reshape(1, 1, 1, 1, 4))


BLOB = len(CODECS["dram"].encode(CHAINS[0][0], None, "float32", block(CHAINS[0][0]).array))


def manager(
    tmp: Path,
    dram_slots: int,
    nvme_blocks: int,
    events: EventLog | None = None,
    device: set[BlockHash] | None = None,
) -> TierManager:
    dram = DramTier(capacity_mb=dram_slots * BLOB / 2**20, slot_bytes=BLOB)
    nvme = NvmeTier(tmp, capacity_mb=nvme_blocks * BLOB / 2**20)
    held = device if device is not None else set()
    return TierManager(
        [dram, nvme], None, CODECS, events or EventLog(), device_has=held.__contains__
    )


def evict(m: TierManager, device: set[BlockHash], chain: list[BlockHash]) -> None:
    """The device held `chain` and evicts it tail first (it frees a request's tail first)."""
    device.update(chain)
    for h in reversed(chain):
        m.demote(block(h))
        device.discard(h)


def where(m: TierManager, hashes: list[BlockHash]) -> list[str]:
    return ["+".join(sorted(m.held_locally(h))) or "-" for h in hashes]


def test_demotion_cascades_dram_to_nvme_to_dropped(tmp_path: Path) -> None:
    events, device = EventLog(), set[BlockHash]()
    m = manager(tmp_path, dram_slots=2, nvme_blocks=2, events=events, device=device)
    chain = CHAINS[0][:5]
    evict(m, device, chain)
    # Tail first in, so tail first out: the head stays in the fastest tier.
    assert where(m, chain) == ["dram", "dram", "nvme", "nvme", "-"]
    kinds = [
        (type(e).__name__, getattr(e, "tier", getattr(e, "dst_tier", ""))) for e in events.drain()
    ]
    assert ("BlockMoved", "nvme") in kinds and ("BlockRemoved", "nvme") in kinds
    m.check_integrity()
    assert m.stats.demoted == 5 and m.stats.dropped == 1


def test_victims_are_leaves_first(tmp_path: Path) -> None:
    m = manager(tmp_path, dram_slots=3, nvme_blocks=10)
    for h in CHAINS[0][:3]:  # head first: the head is the least recently used
        m.demote(block(h))
    m.demote(block(CHAINS[2][1]))  # needs a slot: the leaf CHAINS[0][2] goes, not the head
    assert where(m, CHAINS[0][:3]) == ["dram", "dram", "nvme"]
    m.check_integrity()


def test_dropping_a_prefix_drops_its_suffix(tmp_path: Path) -> None:
    device: set[BlockHash] = set()
    m = manager(tmp_path, dram_slots=2, nvme_blocks=0, device=device)
    chain = CHAINS[0]
    m.demote(block(chain[1]))  # its parent is nowhere (nor on the device): refused
    assert where(m, chain[:2]) == ["-", "-"]
    device.add(chain[0])
    m.demote(block(chain[1]))  # the parent is on the device: taken
    m.demote(block(CHAINS[2][1]))  # its parent CHAINS[2][0] == chain[0] is on the device too
    assert where(m, [chain[1], CHAINS[2][1]]) == ["dram", "dram"]
    m.tier("dram").pin([chain[1], CHAINS[2][1]])  # being read: no victim in DRAM
    # The device evicts chain[0] and no tier can take it: both of its children go with it
    # rather than stay unreachable.
    assert not m.demote(block(chain[0]))
    device.discard(chain[0])
    assert where(m, [chain[1], CHAINS[2][1]]) == ["-", "-"]
    m.check_integrity()


def test_pinned_blocks_are_not_victims(tmp_path: Path) -> None:
    m = manager(tmp_path, dram_slots=1, nvme_blocks=0)
    m.demote(block(CHAINS[0][0]))
    m.tier("dram").pin([CHAINS[0][0]])
    assert not m.demote(block(CHAINS[1][3])) or where(m, [CHAINS[0][0]]) == ["dram"]
    assert where(m, [CHAINS[0][0]]) == ["dram"]
    m.check_integrity()


def test_lookup_spans_tiers_and_read_verifies(tmp_path: Path) -> None:
    device: set[BlockHash] = set()
    m = manager(tmp_path, dram_slots=2, nvme_blocks=10, device=device)
    chain = CHAINS[0][:5]
    evict(m, device, chain)
    assert m.lookup(chain + [CHAINS[1][4]]) == [TierHit("dram", 0, 2), TierHit("nvme", 2, 5)]
    ranges = [("dram", chain[:2]), ("nvme", chain[2:])]
    result = m.read(ranges)
    assert [b.block_hash for b in result.blocks] == chain and not result.bad
    assert all(b.array.tobytes() == block(b.block_hash).array.tobytes() for b in result.blocks)
    assert [t.num_blocks for t in result.transfers] == [2, 3]


def test_corrupt_file_is_a_miss_that_drops_its_suffix(tmp_path: Path) -> None:
    events, device = EventLog(), set[BlockHash]()
    m = manager(tmp_path, dram_slots=0, nvme_blocks=10, events=events, device=device)
    chain = CHAINS[0][:4]
    evict(m, device, chain)
    m.tier("nvme").flush()  # type: ignore[attr-defined]
    path = tmp_path / file_name(chain[1], chain[0])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    result = m.read([("nvme", chain)])
    assert [b.block_hash for b in result.blocks] == chain[:1]
    assert result.bad == [("nvme", chain[1])]
    events.drain()
    m.settle(result)
    assert where(m, chain) == ["nvme", "-", "-", "-"]  # chain[2:] could never be reached again
    removed = [h for e in events.drain() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(chain[1:])
    assert m.stats.failed == {"nvme": 1}
    m.check_integrity()


def test_restart_adopts_the_folder_without_orphans(tmp_path: Path) -> None:
    device: set[BlockHash] = set()
    m = manager(tmp_path, dram_slots=0, nvme_blocks=10, device=device)
    evict(m, device, CHAINS[0][:3])
    m.close()
    events = EventLog()
    again = manager(tmp_path, dram_slots=0, nvme_blocks=10, events=events)
    assert where(again, CHAINS[0][:3]) == ["nvme"] * 3
    stored = {h for e in events.drain() if isinstance(e, BlockStored) for h in e.block_hashes}
    assert stored == set(CHAINS[0][:3])  # announced, for the router's index
    again.close()
    (tmp_path / file_name(CHAINS[0][0], None)).unlink()  # the head vanished while down
    third = manager(tmp_path, dram_slots=0, nvme_blocks=10)
    assert where(third, CHAINS[0][:3]) == ["-", "-", "-"]  # its suffix is dropped on start
    assert list(tmp_path.iterdir()) == []
    third.check_integrity()
    third.close()


def test_shared_tier_takes_blocks_reused_enough(tmp_path: Path, redis_url: str) -> None:
    shared = RedisTier(redis_url, namespace=uuid.uuid4().hex)
    dram = DramTier(capacity_mb=4 * BLOB / 2**20, slot_bytes=BLOB)
    m = TierManager([dram], shared, CODECS, EventLog(), min_reuse=2)
    h = CHAINS[0][0]
    m.demote(block(h))
    assert m.note_reuse([h]) == []
    assert m.note_reuse([h]) == [h]
    assert m.share_held(h) and shared.contains_prefix([h]) == 1  # queued: held already
    assert m.note_reuse([h]) == []  # shared once
    shared.flush()
    # Garbage under the key (another writer, a bit flip): a miss, and the key is deleted.
    redis.Redis.from_url(redis_url).set(shared.key(h), b"garbage")
    result = m.read([("redis", [h])])
    assert result.blocks == [] and result.bad == [("redis", h)]
    m.settle(result)
    shared.flush()  # the delete goes through the write queue too
    assert shared.contains_prefix([h]) == 0
    m.close()


# ---- the state machine ------------------------------------------------------------------------


class TierMachine(RuleBasedStateMachine):
    """Random computes, device evictions, loads and file corruptions against small tiers.

    After every step: the manager agrees with its tiers, no held block lacks its parent (in a
    tier or on the device), and replaying the events gives exactly what each tier holds, so every
    block is in some tier or was explicitly removed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp())
        self.device: dict[BlockHash, BlockHash | None] = {}
        self.events = EventLog()
        self.m = manager(
            self.dir, dram_slots=3, nvme_blocks=4, events=self.events, device=self.device
        )  # type: ignore[arg-type]
        self.mirror: dict[str, set[BlockHash]] = {"dram": set(), "nvme": set()}
        self.ever: set[BlockHash] = set()

    @rule(chain=st.integers(0, 2), n=st.integers(1, 7))
    def compute(self, chain: int, n: int) -> None:
        for h in CHAINS[chain][:n]:
            self.device[h] = PARENT[h]

    @rule(data=st.data())
    def evict_from_device(self, data: st.DataObject) -> None:
        if self.device:
            h = data.draw(st.sampled_from(sorted(self.device)))
            self.m.demote(block(h))
            self.ever.add(h)
            del self.device[h]

    @rule(chain=st.integers(0, 2), n=st.integers(1, 7))
    def load(self, chain: int, n: int) -> None:
        hashes = CHAINS[chain][:n]
        d = 0
        while d < len(hashes) and hashes[d] in self.device:
            d += 1
        hits = self.m.lookup(hashes[d:])
        ranges = [(hit.tier, hashes[d + hit.start : d + hit.end]) for hit in hits]
        self.m.pin(ranges)
        result = self.m.read(ranges)
        self.m.unpin(ranges)
        self.m.settle(result)
        for b in result.blocks:
            assert b.array.tobytes() == block(b.block_hash).array.tobytes()
            self.device[b.block_hash] = b.parent

    @rule(data=st.data())
    def corrupt_a_file(self, data: st.DataObject) -> None:
        nvme = self.m.tier("nvme")
        nvme.flush()  # type: ignore[attr-defined]
        held = sorted(nvme.entries().items())
        if held:
            h, parent = data.draw(st.sampled_from(held))
            path = self.dir / file_name(h, parent)
            raw = bytearray(path.read_bytes())
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x01
            path.write_bytes(bytes(raw))

    @invariant()
    def consistent(self) -> None:
        self.m.check_integrity()
        for e in self.events.drain():
            if isinstance(e, BlockStored):
                self.mirror[e.tier].update(e.block_hashes)
            elif isinstance(e, BlockMoved):
                self.mirror[e.src_tier].difference_update(e.block_hashes)
                self.mirror[e.dst_tier].update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                self.mirror[e.tier].difference_update(e.block_hashes)
        for tier in self.m.local:
            assert self.mirror[tier.name] == set(tier.entries()), f"events vs {tier.name}"

    def teardown(self) -> None:
        self.m.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TierMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_tier_machine = TierMachine.TestCase


def test_blocks_pushed_down_keep_their_parent(tmp_path: Path) -> None:
    device: set[BlockHash] = set()
    m = manager(tmp_path, dram_slots=2, nvme_blocks=4, device=device)
    chain = CHAINS[0][:4]
    evict(m, device, chain)
    assert where(m, chain) == ["dram", "dram", "nvme", "nvme"]  # 2 and 3 came down from DRAM
    # Block 2 turns out corrupt: block 3, its child, is unreachable and must go with it.
    m.settle(FetchResult(bad=[("nvme", chain[2])]))
    assert where(m, chain) == ["dram", "dram", "-", "-"]
    m.check_integrity()
