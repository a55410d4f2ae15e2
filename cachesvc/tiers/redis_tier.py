"""Redis tier: blocks shared by every worker of a model through one real Redis.

Keys are `cachesvc:kv:<model fingerprint>:<block hash hex>`, so models never mix and one model's
blocks can be flushed alone. Reads and existence checks are pipelined batches (one round trip per
batch, not per block: LMCache#1238). Redis evicts by itself under `maxmemory`, so a block that
vanished is just a miss. When Redis is down or slow, the call that failed counts an error, and the
tier answers misses without touching the network for `retry_s`, so a dead Redis costs one timeout,
not one per request; after that it reconnects by itself.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from cachesvc.tiers.base import Tier, TierItem, register_tier
from cachesvc.types import BlockHash

KEY_PREFIX = "cachesvc:kv"
_BATCH = 64  # hashes per pipeline: bounds one round trip's reply size


def _chunks(seq: Sequence[BlockHash], size: int) -> Iterator[Sequence[BlockHash]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


@register_tier("redis")
class RedisTier(Tier):
    """A client of `url` (redis:// or rediss:// for TLS) under the namespace of one model."""

    name = "redis"
    shared = True

    def __init__(
        self,
        url: str,
        namespace: str,
        password: str | None = None,
        ttl_s: int | None = None,
        timeout_s: float = 0.5,
        retry_s: float = 2.0,
        tls_ca_file: str | None = None,
        cap_mb_per_s: float | None = None,
    ) -> None:
        super().__init__(cap_mb_per_s)
        import redis  # lazy: only workers configured with Redis need the client

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
        }
        if password is not None:
            options["password"] = password
        if tls_ca_file is not None:
            options["ssl_ca_certs"] = tls_ca_file
        self._client = redis.Redis.from_url(url, **options)
        self._prefix = f"{KEY_PREFIX}:{namespace}:".encode()
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._down_until = 0.0

    def key(self, block_hash: BlockHash) -> bytes:
        return self._prefix + block_hash.hex().encode()

    @property
    def is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _failed(self) -> None:
        self.stats.errors += 1
        self._down_until = time.monotonic() + self.retry_s

    def contains_prefix(self, hashes: Sequence[BlockHash]) -> int:
        if self.is_down:
            return 0
        n = 0
        try:
            for chunk in _chunks(hashes, _BATCH):
                pipe = self._client.pipeline(transaction=False)
                for h in chunk:
                    pipe.exists(self.key(h))
                for found in pipe.execute():
                    if not found:
                        return n
                    n += 1
        except self._errors:
            self._failed()
        return n

    def get(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        out: list[bytes | None] = [None] * len(hashes)
        if not self.is_down:
            try:
                i = 0
                for chunk in _chunks(hashes, _BATCH):
                    pipe = self._client.pipeline(transaction=False)
                    for h in chunk:
                        pipe.get(self.key(h))
                    for value in pipe.execute():
                        out[i] = value
                        i += 1
            except self._errors:
                self._failed()
        num_bytes = sum(len(b) for b in out if b is not None)
        self.stats.hits += sum(b is not None for b in out)
        self.stats.misses += sum(b is None for b in out)
        self.stats.bytes_read += num_bytes
        self.throttle.wait(num_bytes)
        return out

    def put(self, items: Sequence[TierItem]) -> list[BlockHash]:
        if self.is_down or not items:
            self.stats.rejected += len(items)
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for item in items:
                pipe.set(self.key(item.block_hash), item.data, ex=self.ttl_s)
            pipe.execute()
        except self._errors:
            self._failed()
            self.stats.rejected += len(items)
            return []
        self.stats.stored += len(items)
        self.stats.bytes_written += sum(len(item.data) for item in items)
        return [item.block_hash for item in items]

    def remove(self, hashes: Sequence[BlockHash]) -> None:
        if self.is_down or not hashes:
            return
        try:
            self._client.delete(*(self.key(h) for h in hashes))
            self.stats.removed += len(hashes)
        except self._errors:
            self._failed()

    def close(self) -> None:
        with contextlib.suppress(*self._errors):
            self._client.close()
