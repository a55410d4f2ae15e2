"""Redis tier: blocks shared by every worker of a model through one real Redis.

Keys are `cachesvc:kv:<model fingerprint>:<block hash hex>`, so models never mix and one model's
blocks can be flushed alone. Reads and existence checks are pipelined batches (one round trip per
batch, not per block: LMCache#1238). Redis evicts by itself under `maxmemory`, so a block that
vanished is just a miss.

The engine shares blocks from inside the block pool's eviction hook and looks blocks up when it
admits a request, so a Redis that stops answering must not stall its thread:

* Writes and deletes go through a bounded background queue (`queue_mb`), sent by one thread in
  pipelined batches with `timeout_s`. A write that finds the queue full is dropped and counted
  (`writes_dropped`); one that fails is reported by `drain_lost`. Until a write lands, lookups
  and reads answer from the queued blob, as the NVMe tier does.
* Lookups and reads use a short `read_timeout_s`, behind a circuit breaker: after `max_failures`
  failed calls in a row (reads or writes) Redis is skipped for `retry_s`, then one call probes
  it. A frozen Redis costs a few short timeouts, not one per request; a dead one that comes back
  is used again after the next probe.
* After a failed call the next one that succeeds asks the server's `run_id`: a new one means it
  restarted and kept nothing (`stats.restarts`), which a timed-out read alone does not tell.

A retained block is written to live at least until its retention expires: its TTL is the
longer of the tier's `ttl_s` and the retention's time left (with no `ttl_s` keys never expire,
retained or not). That is all the shared tier does with retention: Redis evicts by itself, and
this tier is only ever asked, never managed.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from cachesvc.kv.breaker import CLOSED, OPEN, CircuitBreaker
from cachesvc.kv.redis_client import redis_client
from cachesvc.kv.tiers.base import Tier, TierItem, register_tier
from cachesvc.kv.types import BlockHash

KEY_PREFIX = "cachesvc:kv"
_BATCH = 64  # hashes per pipeline: bounds one round trip's reply size
_DELETE_BYTES = 64  # what a queued delete counts against the queue's budget
T = TypeVar("T")


def _chunks(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


@dataclass(frozen=True)
class _Job:
    """A queued write of `data` (expiring after `ttl_s`, None: never), or a delete (`data`
    None)."""

    block_hash: BlockHash
    data: bytes | None
    ttl_s: int | None = None

    @property
    def num_bytes(self) -> int:
        return _DELETE_BYTES if self.data is None else len(self.data)


def _client(url: str, timeout_s: float, password: str | None, tls_ca_file: str | None) -> Any:
    # One call costs at most one timeout; the breaker retries.
    options: dict[str, Any] = {}
    if password is not None:
        options["password"] = password
    if tls_ca_file is not None:
        options["ssl_ca_certs"] = tls_ca_file
    return redis_client(url, timeout_s, **options)


@register_tier("redis")
class RedisTier(Tier):
    """A client of `url` (redis:// or rediss:// for TLS) under the namespace of one model."""

    name = "redis"
    shared = True
    outside_process = True

    def __init__(
        self,
        url: str,
        namespace: str,
        password: str | None = None,
        ttl_s: int | None = None,
        timeout_s: float = 0.5,
        read_timeout_s: float = 0.1,
        retry_s: float = 2.0,
        max_failures: int = 3,
        queue_mb: float = 64.0,
        tls_ca_file: str | None = None,
        cap_mb_per_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: the wall clock a retention's expiry is read against."""
        super().__init__(cap_mb_per_s)
        import redis

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._reader = _client(url, read_timeout_s, password, tls_ca_file)
        self._writer = _client(url, timeout_s, password, tls_ca_file)
        self._prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self.ttl_s = ttl_s
        self.clock = clock
        self.breaker = CircuitBreaker(max_failures, retry_s)
        self.queue_bytes = int(queue_mb * 2**20)
        self._jobs: deque[_Job] = deque()
        self._pending: dict[BlockHash, bytes] = {}  # blobs queued or being written
        self._queued = 0  # bytes of the jobs queued or being written
        self._num_in_flight = 0  # jobs taken by the writer and not yet settled
        self._lost: list[BlockHash] = []
        self._run_id: str | None = None  # the server's, when last asked
        self._ask_run_id = True  # at the start and after a failed call
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._write_loop, name="redis-writer", daemon=True)
        self._thread.start()

    def key(self, block_hash: BlockHash) -> bytes:
        return self._prefix + block_hash.hex().encode()

    @property
    def is_down(self) -> bool:
        """True while the breaker skips Redis (open or probing)."""
        return self.breaker.state != CLOSED

    def _call(self, fn: Callable[[], T]) -> T | None:
        """`fn()` against Redis through the breaker; None when skipped or failed (counted)."""
        if not self.breaker.allow():
            return None
        try:
            out = fn()
        except self._errors:
            opened = self.breaker.failed()
            with self._cond:  # the writer thread counts too
                self.stats.errors += 1
                self.stats.breaker_opens += int(opened)
                self._ask_run_id = True
            return None
        except BaseException:
            self.breaker.failed()  # never leave a probe outstanding
            raise
        self.breaker.succeeded()
        if self._ask_run_id:
            self._check_restart()
        return out

    def _check_restart(self) -> None:
        """Ask the server's run_id (after a failure): a new one counts a restart. A failed ask
        is asked again after the next call."""
        try:
            run_id = self._reader.info("server").get("run_id")
        except self._errors:
            return
        with self._cond:
            if self._run_id is not None and run_id != self._run_id:
                self.stats.restarts += 1
            self._run_id, self._ask_run_id = run_id, False

    # ---- reads: on the caller's thread, short timeout -----------------------------------------

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        with self._cond:
            queued = [h in self._pending for h in hashes]
        n = 0
        for start in range(0, len(hashes), _BATCH):
            chunk = range(start, min(start + _BATCH, len(hashes)))
            ask = [hashes[i] for i in chunk if not queued[i]]
            found = iter(self._exists(ask) if ask else [])
            for i in chunk:
                if not (queued[i] or next(found)):
                    return n
                n += 1
        return n

    def _exists(self, hashes: Sequence[BlockHash]) -> list[bool]:
        def ask() -> list[bool]:
            pipe = self._reader.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return [bool(found) for found in pipe.execute()]

        return self._call(ask) or [False] * len(hashes)

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        with self._cond:
            out: list[bytes | None] = [self._pending.get(h) for h in hashes]
        missing = [i for i, blob in enumerate(out) if blob is None]
        for chunk in _chunks(missing, _BATCH):
            values = self._call(partial(self._get_batch, [hashes[i] for i in chunk]))
            if values is None:
                break  # failed or skipped: the rest are misses too
            for i, value in zip(chunk, values, strict=True):
                out[i] = value
        num_bytes = sum(len(b) for b in out if b is not None)
        self.stats.hits += sum(b is not None for b in out)
        self.stats.misses += sum(b is None for b in out)
        self.stats.bytes_read += num_bytes
        self.throttle.wait(num_bytes)
        return out

    def _get_batch(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        pipe = self._reader.pipeline(transaction=False)
        for h in hashes:
            pipe.get(self.key(h))
        return list(pipe.execute())

    # ---- writes: queued, sent by the writer thread ------------------------------------------

    def put(self, items: Sequence[TierItem]) -> list[BlockHash]:
        """Queue blobs for the writer; returns the hashes queued (or already queued). Refused
        while the breaker is open, dropped (counted) when the queue is full."""
        stored: list[BlockHash] = []
        with self._cond:
            if self.breaker.state == OPEN or self._closing:
                self.stats.rejected += len(items)
                return []
            for item in items:
                if item.block_hash in self._pending:
                    stored.append(item.block_hash)
                    continue
                if self._queued + len(item.data) > self.queue_bytes:
                    self.stats.writes_dropped += 1
                    continue
                self._enqueue(_Job(item.block_hash, item.data, self._ttl(item)))
                stored.append(item.block_hash)
        return stored

    def _ttl(self, item: TierItem) -> int | None:
        """The key's TTL: the tier's, or longer for a retained block (whole seconds, up)."""
        if item.retention is None or self.ttl_s is None:
            return self.ttl_s
        left = math.ceil(item.retention.expires_at - self.clock())
        return max(self.ttl_s, left)

    def remove(self, hashes: Sequence[BlockHash]) -> None:
        """Forget queued writes of `hashes` and queue deletes (skipped while Redis is down)."""
        with self._cond:
            for h in hashes:
                self._pending.pop(h, None)  # the writer skips a write no longer pending
            if self.is_down or self._closing:
                return
            for h in hashes:
                if self._queued + _DELETE_BYTES <= self.queue_bytes:
                    self._enqueue(_Job(h, None))
                else:
                    self.stats.writes_dropped += 1

    def _enqueue(self, job: _Job) -> None:
        """Under the lock."""
        if job.data is not None:
            self._pending[job.block_hash] = job.data
        self._jobs.append(job)
        self._queued += job.num_bytes
        self._cond.notify_all()

    def drain_lost(self) -> list[BlockHash]:
        with self._cond:
            lost, self._lost = self._lost, []
            return lost

    def flush(self) -> None:
        """Block until every queued write and delete was sent (or failed)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs and not self._num_in_flight)

    def clear(self) -> int:
        """Delete every block of this namespace (all workers' copies of this model), queued
        writes included; returns how many keys were deleted (0 while Redis is down)."""
        with self._cond:
            self._pending.clear()  # the writer skips writes no longer pending
        self.flush()  # a batch already being sent lands before the scan, not after it
        deleted = self._call(self._delete_namespace) or 0
        with self._cond:
            self.stats.removed += deleted
        return deleted

    def _delete_namespace(self) -> int:
        pattern = re.sub(rb"([*?\[\]\\])", rb"\\\1", self._prefix) + b"*"
        keys = list(self._writer.scan_iter(match=pattern, count=1000))
        return sum(self._writer.delete(*chunk) for chunk in _chunks(keys, 1000))

    def gauges(self) -> dict[str, float]:
        with self._cond:
            depth, num_bytes = len(self._jobs) + self._num_in_flight, self._queued
        return {
            "queue_depth": depth,
            "queue_bytes": num_bytes,
            "breaker_open": float(self.is_down),
        }

    def close(self) -> None:
        """Send what is queued (the breaker drops it if Redis is down), then disconnect."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        for client in (self._reader, self._writer):
            with contextlib.suppress(*self._errors):
                client.close()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return  # closing, and everything was sent
                batch = [self._jobs.popleft() for _ in range(min(_BATCH, len(self._jobs)))]
                # A write whose block was removed since it was queued is not sent.
                sends = [
                    j for j in batch if j.data is None or self._pending.get(j.block_hash) is j.data
                ]
                self._num_in_flight = len(batch)
            ok = bool(sends) and self._call(partial(self._send, sends)) is not None
            self._settle(batch, sends, ok)

    def _send(self, jobs: Sequence[_Job]) -> bool:
        pipe = self._writer.pipeline(transaction=False)
        for job in jobs:
            if job.data is None:
                pipe.delete(self.key(job.block_hash))
            else:
                pipe.set(self.key(job.block_hash), job.data, ex=job.ttl_s)
        pipe.execute()
        return True

    def _settle(self, batch: Sequence[_Job], sent: Sequence[_Job], ok: bool) -> None:
        with self._cond:
            writes = [j for j in sent if j.data is not None]
            for job in writes:
                if self._pending.get(job.block_hash) is job.data:
                    del self._pending[job.block_hash]
                if not ok:
                    self._lost.append(job.block_hash)
            if ok:
                self.stats.stored += len(writes)
                self.stats.bytes_written += sum(j.num_bytes for j in writes)
                self.stats.removed += len(sent) - len(writes)
            else:
                self.stats.rejected += len(writes)
            self._queued -= sum(j.num_bytes for j in batch)
            self._num_in_flight = 0
            self._cond.notify_all()
