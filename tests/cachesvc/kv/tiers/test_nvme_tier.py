"""NVMe tier: atomic 0600 files, an index rebuilt from the folder after a restart, the size
budget, and failures (disk full, unusable folder, vanished file) that never raise."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from cachesvc.kv.tiers.base import TierItem
from cachesvc.kv.tiers.nvme import NvmeTier, file_name
from cachesvc.kv.types import BlockHash


def h(i: int) -> BlockHash:
    return BlockHash((i + 1).to_bytes(16, "little"))  # all zeros would read as "no parent"


def item(i: int, size: int = 1000) -> TierItem:
    return TierItem(h(i), h(i - 1) if i else None, bytes([i % 256]) * size)


def test_files_are_atomic_private_and_readable(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path / "kv", capacity_mb=1)
    assert tier.put([item(0), item(1)]) == [h(0), h(1)]
    assert tier.get([h(0), h(1), h(2)]) == [item(0).data, item(1).data, None]  # even if queued
    tier.flush()
    names = sorted(p.name for p in (tmp_path / "kv").iterdir())
    assert names == sorted(file_name(h(i), item(i).parent) for i in (0, 1))  # no temp left
    for p in (tmp_path / "kv").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert tier.get([h(1)]) == [item(1).data]
    tier.close()


def test_restart_rebuilds_index_and_lru_order(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=1)
    for i in range(3):
        tier.put([item(i)])
        tier.flush()
        os.utime(tmp_path / file_name(h(i), item(i).parent), (1000 + i, 1000 + i))
    tier.close()
    (tmp_path / ".stale.kv.tmp-1-1").write_bytes(b"half a block")  # a crash mid-write
    again = NvmeTier(tmp_path, capacity_mb=1)
    assert again.entries() == {h(0): None, h(1): h(0), h(2): h(1)}
    assert again.oldest(3) == [h(0), h(1), h(2)]
    assert again.used_bytes == 3000
    assert not (tmp_path / ".stale.kv.tmp-1-1").exists()
    assert again.get([h(2)]) == [item(2).data]
    again.close()


def test_budget_refuses_until_room_is_made(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=2500 / 2**20)
    assert tier.put([item(0), item(1), item(2)]) == [h(0), h(1)]
    assert not tier.room_for(1000) and tier.stats.rejected == 1
    tier.remove([h(0)])
    assert tier.room_for(1000)
    tier.flush()
    assert not (tmp_path / file_name(h(0), None)).exists()
    tier.close()


def test_remove_while_queued_leaves_no_file(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=1)
    tier.put([item(i) for i in range(20)])
    tier.remove([h(i) for i in range(20)])
    tier.flush()
    assert list(tmp_path.iterdir()) == []
    assert tier.used_bytes == 0
    tier.close()


def test_disk_full_stops_admission_and_reports_the_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fake, because a full disk cannot be made here without mount rights (and root ignores
    # read-only permission bits): the write fails with ENOSPC as a real full disk would.
    tier = NvmeTier(tmp_path, capacity_mb=1)

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    assert tier.put([item(0)]) == [h(0)]  # accepted: the write is in the background
    tier.flush()
    assert tier.drain_lost() == [h(0)]
    assert not tier.admitting and tier.stats.errors == 1
    assert tier.put([item(1)]) == [] and tier.get([h(0)]) == [None]
    assert [p for p in tmp_path.iterdir()] == []  # the temp file is gone
    tier.close()


def test_unusable_folder_is_a_tier_that_only_misses(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a folder")
    tier = NvmeTier(blocker / "kv", capacity_mb=1)
    assert tier.stats.errors == 1 and not tier.admitting
    assert tier.put([item(0)]) == [] and tier.get([h(0)]) == [None]
    tier.close()


def test_vanished_file_is_a_miss_and_lost(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=1)
    tier.put([item(0)])
    tier.flush()
    (tmp_path / file_name(h(0), None)).unlink()
    assert tier.get([h(0)]) == [None]
    assert tier.drain_lost() == [h(0)] and tier.contains_prefix([h(0)]) == 0
    tier.close()


def test_borrowed_reads_reuse_memory_and_stay_exact(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=1)
    items = [item(i, size=2000 - 100 * i) for i in range(4)]
    tier.put(items)
    tier.flush()
    [fresh] = tier.get([h(0)])
    assert bytes(fresh) == items[0].data
    views = []
    for batch in ((0, 1), (2, 3)):  # the second borrow reuses the first's (larger) slots
        with tier.borrow():
            got = tier.get([h(i) for i in batch])
            assert [bytes(b) for b in got] == [items[i].data for i in batch]
            views.append(got)
    first, second = (memoryview(v[0]) for v in views)
    assert bytes(first[:10]) == items[2].data[:10]  # slot 0 now holds block 2: memory reused
    assert bytes(fresh) == items[0].data  # a read outside a borrow owns its buffer
    tier.close()


def test_a_truncated_file_reads_short_inside_a_borrow(tmp_path: Path) -> None:
    tier = NvmeTier(tmp_path, capacity_mb=1)
    tier.put([item(0, size=4000)])
    tier.flush()
    path = tmp_path / file_name(h(0), None)
    path.write_bytes(item(0).data[:100])
    with tier.borrow():
        [got] = tier.get([h(0)])
        assert got is not None and bytes(got) == item(0).data[:100]  # the codec rejects it
    tier.close()
