"""NVMe tier: one folder of block files under a size budget, given up in retention and quota
order, an eviction policy's within a retention class (`cachesvc.kv.eviction`: least recently
used first by default; see `retaining.RetainingTier`). A tenant's budget and share count bytes.

A file is named `<hash>-<parent>.kv`, so the index (and the chain structure the manager needs)
is rebuilt from a directory listing on start: a restarted worker keeps its disk cache. Writes go
through a background thread as temp file + fsync + rename, so a reader (or a crash) never sees a
half-written block; files are mode 0600 in a 0700 folder. Until a write lands, `get` serves the
blob from memory. A fetch that lands at once (`borrow`) reads into reused memory (`ReadArena`),
5x faster from the page cache than into fresh buffers. A failed write (disk full, read-only
folder) stops admission for a while and reports the block as lost; the worker never fails
because of this tier. Retentions are journaled beside the files (`retention_journal`), so a
restarted worker keeps them too, expiry and all.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cachesvc.kv.quotas import TenantQuota
from cachesvc.kv.retention import Retention
from cachesvc.kv.retention_book import NO_QUOTA, RetentionBook
from cachesvc.kv.tiers.base import TierItem, register_tier
from cachesvc.kv.tiers.read_arena import ReadArena
from cachesvc.kv.tiers.retaining import RetainingTier
from cachesvc.kv.tiers.retention_journal import RetentionJournal
from cachesvc.kv.types import BlockHash

SUFFIX = ".kv"
_NO_PARENT = "0" * 32
# After a failed write, stop admitting for this long: a full disk rarely frees itself at once.
ADMIT_RETRY_S = 30.0
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


@dataclass
class _File:
    size: int
    parent: BlockHash | None
    pending: bytes | None = None  # the blob while its write is queued


def file_name(block_hash: BlockHash, parent: BlockHash | None) -> str:
    return f"{block_hash.hex()}-{parent.hex() if parent else _NO_PARENT}{SUFFIX}"


def _parse(name: str) -> tuple[BlockHash, BlockHash | None] | None:
    stem = name[: -len(SUFFIX)]
    parts = stem.split("-")
    if not name.endswith(SUFFIX) or len(parts) != 2 or any(len(p) != 32 for p in parts):
        return None
    try:
        h, p = bytes.fromhex(parts[0]), bytes.fromhex(parts[1])
    except ValueError:
        return None
    return BlockHash(h), None if parts[1] == _NO_PARENT else BlockHash(p)


@register_tier("nvme")
class NvmeTier(RetainingTier):
    """Files under `path`, at most `capacity_mb` of them in total, victims offered in the order
    of eviction policy `policy` within retention classes (restored least recently used first
    after a restart); `clock` tells when a retention expires (wall clock)."""

    name = "nvme"
    outside_process = True

    def __init__(
        self,
        path: str | Path,
        capacity_mb: float,
        cap_mb_per_s: float | None = None,
        policy: str = "lru",
        clock: Callable[[], float] = time.time,
    ):
        super().__init__(cap_mb_per_s)
        self.path = Path(path)
        self.capacity_bytes = int(capacity_mb * 2**20)
        self._files: dict[BlockHash, _File] = {}
        self._book: RetentionBook[BlockHash] = RetentionBook(policy, self.capacity_bytes, clock)
        self._journal = RetentionJournal(self.path)
        self._used = 0
        self._lost: list[BlockHash] = []
        self._admit_after = 0.0  # monotonic time before which puts are refused
        self._queue: queue.Queue[tuple[BlockHash, _File] | None] = queue.Queue()
        self._tmp_seq = 0
        self._arena = ReadArena()
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._rebuild()
        except OSError:
            self.stats.errors += 1
            self._admit_after = float("inf")  # unusable folder: a tier that only misses
        self._book.on_change = self._journal_change  # after the rebuild: it replayed the file
        self._writer = threading.Thread(target=self._write_loop, name="nvme-writer", daemon=True)
        self._writer.start()

    @property
    def admitting(self) -> bool:
        return time.monotonic() >= self._admit_after

    @property
    def used_bytes(self) -> int:
        return self._used

    def _rebuild(self) -> None:
        found: list[tuple[float, BlockHash, _File]] = []
        for entry in os.scandir(self.path):
            if entry.name.startswith(".") and ".tmp" in entry.name:
                os.unlink(entry.path)  # a write interrupted by a crash
                continue
            parsed = _parse(entry.name)
            if parsed is None or not entry.is_file():
                continue
            st = entry.stat()
            found.append((st.st_mtime, parsed[0], _File(st.st_size, parsed[1])))
        kept = self._journal.load()
        # No budget yet: the quotas come later (`set_quotas`), and trim what they must then.
        self._book.default_quota = NO_QUOTA
        for _, h, f in sorted(found, key=lambda t: t[0]):
            self._files[h] = f
            owner = kept[h].tenant if h in kept else None  # an unretained block's is not kept
            self._book.add(h, f.size, f.parent, tenant=owner)
            self._used += f.size
        for h, retention in kept.items():  # in the order they were retained: oldest first
            if h in self._files:
                self._book.retain(h, retention)  # an expired one is ignored
        self._book.default_quota = TenantQuota()
        self._journal.rewrite(self._book.retained())

    def _journal_change(self, block_hash: BlockHash, retention: Retention | None) -> None:
        """The book changed a retention (under the lock): journal it, best effort."""
        try:
            self._journal.record(block_hash, retention)
        except OSError:
            self.stats.errors += 1  # the block keeps its retention until a restart

    # ---- the interface ----------------------------------------------------------------------

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._files:
                    break
                n += 1
            return n

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        out = [self._get_one(h) for h in hashes]
        self.throttle.wait(sum(len(b) for b in out if b is not None))
        return out

    def _get_one(self, block_hash: BlockHash) -> bytes | None:
        with self._lock:
            f = self._files.get(block_hash)
            if f is None:
                self.stats.misses += 1
                return None
            self._book.use(block_hash, f.parent)
            data = f.pending
        path = self.path / file_name(block_hash, f.parent)
        if data is None:
            try:
                data = self._read(path)
                os.utime(path)  # the LRU order survives a restart through mtimes
            except OSError:
                self.stats.errors += 1
                self.stats.misses += 1
                self._forget(block_hash, lost=True)
                return None
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return data

    def _read(self, path: Path) -> bytes:
        """The whole file, into arena memory while borrowed (writable either way, so a raw blob
        decodes in place)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            view = self._arena.buffer(size)
            n = os.readv(fd, [view])
        finally:
            os.close(fd)
        return cast(bytes, view[:n])

    @contextmanager
    def borrow(self) -> Iterator[None]:
        """While open, `get` on this thread reads into reused memory and returns views of it,
        valid until the block closes (see `ReadArena`)."""
        with self._arena.borrow():
            yield

    def put(self, items: Sequence[TierItem]) -> list[BlockHash]:
        stored: list[BlockHash] = []
        with self._lock:
            for item in items:
                if item.block_hash in self._files:
                    self._touch(item)
                    stored.append(item.block_hash)
                    continue
                if not self.admitting or not self._has_room(len(item.data)):
                    self.stats.rejected += 1
                    continue
                f = _File(len(item.data), item.parent, pending=item.data)
                self._files[item.block_hash] = f
                self._add(item, f.size)
                self._used += f.size
                self._queue.put((item.block_hash, f))
                stored.append(item.block_hash)
            self._compact_journal()
        return stored

    def _compact_journal(self) -> None:
        """Under the lock: rewrite the journal once it is mostly superseded lines."""
        if self._journal.worth_compacting(self._book.num_retained):
            try:
                self._journal.rewrite(self._book.retained())
            except OSError:
                self.stats.errors += 1

    def remove(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._forget(h, lost=False)

    def _forget(self, block_hash: BlockHash, lost: bool) -> None:
        with self._lock:
            f = self._files.pop(block_hash, None)
            if f is None:
                return
            self._book.remove(block_hash)
            self._used -= f.size
            self.stats.removed += 1
            if lost:
                self._lost.append(block_hash)
            if f.pending is not None:
                return  # the writer sees it is gone and deletes what it wrote
        _unlink(self.path / file_name(block_hash, f.parent))

    def drain_lost(self) -> list[BlockHash]:
        with self._lock:
            lost, self._lost = self._lost, []
            return lost

    def room_for(self, num_bytes: int) -> bool:
        with self._lock:
            return self.admitting and self._has_room(num_bytes)

    def _has_room(self, num_bytes: int) -> bool:
        return self._used + num_bytes <= self.capacity_bytes

    def fits_at_all(self, num_bytes: int) -> bool:
        return self.admitting and num_bytes <= self.capacity_bytes

    def entries(self) -> dict[BlockHash, BlockHash | None]:
        with self._lock:
            return {h: self._files[h].parent for h in self._book}

    def flush(self) -> None:
        """Block until every queued write has landed (or failed)."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        with self._lock:
            self._journal.close()

    # ---- the writer thread ------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, f: _File) -> None:
        assert f.pending is not None
        final = self.path / file_name(block_hash, f.parent)
        self._tmp_seq += 1
        tmp = self.path / f".{final.name}.tmp-{os.getpid()}-{self._tmp_seq}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                view = memoryview(f.pending)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            self._on_write_error(block_hash, f, tmp, exc)
            return
        self.stats.bytes_written += f.size
        with self._lock:
            still_held = self._files.get(block_hash) is f
            if still_held:
                f.pending = None
                self.stats.stored += 1
        if not still_held:
            _unlink(final)  # removed while its write was queued

    def _on_write_error(self, block_hash: BlockHash, f: _File, tmp: Path, exc: OSError) -> None:
        _unlink(tmp)
        self.stats.errors += 1
        if exc.errno in _FULL_ERRNOS:
            self._admit_after = time.monotonic() + ADMIT_RETRY_S
        with self._lock:
            if self._files.get(block_hash) is f:
                del self._files[block_hash]
                self._book.remove(block_hash)
                self._used -= f.size
                self._lost.append(block_hash)


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
