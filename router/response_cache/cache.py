"""The response cache: a deterministic request's complete answer, returned without a worker.

When a request is fully deterministic (greedy, beam search, or sampling with an explicit seed),
the cheapest answer is the one already given: `key(prompt + sampling + tenant + model) ->
answer`. Only answers that finished normally are stored (every sample ended with "stop" or
"length"), never a cancelled or failed stream, nor one computed from KV a lossy (quantized) tier
gave back, which a fresh computation might not repeat.

The key is a BLAKE2b of everything that determines the output: the tenant's whole cache salt,
the model fingerprint, the prompt's token ids and every sampling parameter, each
length-prefixed. Entries are signed over their key and checked before they are served
(`router.response_cache.entry`), and live in memory (an LRU bounded in bytes) or in Redis (shared by
routers, with a TTL; `router.response_cache.store`). A lookup is the only store call on a request's
path; answers are stored after the stream's end, from a bounded queue. A store that fails is a
miss, never an error.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
import sys
from collections import deque
from collections.abc import Sequence

from router.config import RouterConfig
from router.response_cache.entry import (
    FINISHED,
    CachedResponse,
    CachedSample,
    EntryCodec,
    EntryShape,
)
from router.response_cache.store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoreStats,
)
from workers.protocol import StreamDelta, Usage
from workers.sampling_params import SamplingParams

_log = logging.getLogger(__name__)
_KEY_TAG = b"cachesvc/response/v2"

__all__ = [  # the entry's and the stores' names too: the cache's users need no other module
    "CachedResponse",
    "CachedSample",
    "EntryShape",
    "ResponseCache",
    "ResponseCollector",
    "StoreStats",
    "is_deterministic",
    "make_response_cache",
    "num_samples",
    "response_key",
]


def is_deterministic(params: SamplingParams) -> bool:
    """Whether the same request always gets the same answer: greedy, beam search, or a seed."""
    return params.temperature == 0 or params.beam_width > 1 or params.seed is not None


def num_samples(params: SamplingParams) -> int:
    """How many samples the answer has: beam search returns its best beam alone."""
    return 1 if params.beam_width > 1 else params.n


def response_key(
    model_fingerprint: str,
    cache_salt: str | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
) -> bytes:
    """The cache key of a request (16 bytes). The whole salt is hashed, as the KV block hashes
    hash it, so two tenants (or two salts) never share an entry however long their names."""
    ids = array.array("I", prompt_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    sampling = json.dumps(dataclasses.asdict(params), sort_keys=True, default=list)
    salt = (cache_salt or "").encode()  # None and "" are one salt, as for the KV blocks
    digest = hashlib.blake2b(digest_size=16)
    parts = (_KEY_TAG, salt, model_fingerprint.encode(), sampling.encode(), ids.tobytes())
    for part in parts:
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.digest()


class ResponseCollector:
    """Gathers a generated stream's deltas into the answer to store."""

    def __init__(self, num_samples: int) -> None:
        self._tokens: list[list[int]] = [[] for _ in range(num_samples)]
        self._text: list[list[str]] = [[] for _ in range(num_samples)]
        self._final: list[tuple[str, Usage] | None] = [None] * num_samples

    def add(self, delta: StreamDelta) -> None:
        if not 0 <= delta.index < len(self._tokens):
            return
        self._tokens[delta.index] += delta.token_ids
        self._text[delta.index].append(delta.text)
        if delta.finish_reason is not None and delta.usage is not None:
            self._final[delta.index] = (delta.finish_reason, delta.usage)

    def result(self) -> CachedResponse | None:
        """The answer, or None unless every sample finished normally from exact KV."""
        samples = []
        for tokens, text, final in zip(self._tokens, self._text, self._final, strict=True):
            if final is None or final[0] not in FINISHED:
                return None
            if final[1].lossy_kv:
                return None  # quantized KV: another run (or a fresh prefill) may differ
            samples.append(CachedSample(tuple(tokens), "".join(text), final[0], final[1]))
        return CachedResponse(tuple(samples))


class ResponseCache:
    """The cache the router consults; `store` decides where entries live.

    `get` is the only call a request waits on. `offer` queues an answer for a background task
    that signs it and writes it to the store: at most `queue_entries` wait (more are dropped
    and counted), and an answer whose entry would exceed `max_entry_bytes` is not stored.
    """

    def __init__(
        self,
        store: ResponseStore,
        codec: EntryCodec,
        stats: StoreStats | None = None,
        max_entry_bytes: int = 256 * 2**10,
        queue_entries: int = 256,
    ) -> None:
        self.store = store
        self.codec = codec
        self.stats = stats if stats is not None else StoreStats()
        self.max_entry_bytes = max_entry_bytes
        self.queue_entries = queue_entries
        self._queue: deque[tuple[bytes, CachedResponse]] = deque()
        self._writer: asyncio.Task[None] | None = None

    async def get(self, key: bytes, shape: EntryShape) -> CachedResponse | None:
        """The answer stored under `key` if it is authentic and fits `shape`; None (a miss)
        otherwise. Never raises; waits at most the store's lookup bound."""
        blob = await self.store.get(key)
        response = None if blob is None else self.codec.decode(key, blob, shape)
        if blob is not None and response is None:
            self.stats.rejected += 1
        if response is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return response

    def offer(self, key: bytes, response: CachedResponse) -> None:
        """Queue `response` to be stored under `key`; returns at once (needs a running loop).
        Dropped (counted) when the queue is full or the answer is too large."""
        if response.min_encoded_size() > self.max_entry_bytes:
            self.stats.too_large += 1
            return
        if len(self._queue) >= self.queue_entries:
            self.stats.dropped += 1
            return
        self._queue.append((key, response))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())

    async def put(self, key: bytes, response: CachedResponse) -> bool:
        """Sign and store `response` now; whether it was stored."""
        blob = self.codec.encode(key, response)
        if len(blob) > self.max_entry_bytes:
            self.stats.too_large += 1
            return False
        stored = await self.store.put(key, blob)
        self.stats.stores += int(stored)
        return stored

    async def flush(self) -> None:
        """Wait until every queued answer was written (or failed to be)."""
        while self._writer is not None and not self._writer.done():
            await asyncio.shield(self._writer)  # a cancelled flush leaves the writer be

    async def clear(self) -> int:
        """Drop every entry, queued ones included; returns how many were stored (as far as
        the store can tell)."""
        self._queue.clear()
        await self.flush()  # a write already under way lands before the clear, not after it
        return await self.store.clear()

    async def close(self) -> None:
        """Forget what is queued (it is a cache) and disconnect from the store."""
        self._queue.clear()
        if self._writer is not None:
            self._writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._writer
        await self.store.close()

    async def _write_queued(self) -> None:
        while self._queue:
            key, response = self._queue.popleft()
            try:
                await self.put(key, response)
            except Exception:  # a bug, not an outage: the stores never raise
                self.stats.errors += 1
                _log.exception("storing an answer in the response cache failed")


def make_response_cache(config: RouterConfig) -> ResponseCache | None:
    """The cache the config asks for: None when `response_cache_mb` is 0; in Redis when the
    config names one (`response_cache_redis_url`, else the index's `redis_url`), else in
    memory. Reads the key file."""
    if config.response_cache_mb <= 0:
        return None
    stats = StoreStats()
    url = config.response_cache_redis_url or config.redis_url
    secret = config.read_response_cache_key()
    if secret is None:
        # Entries signed with a key of this process alone: safe, but no other router (nor this
        # one after a restart) can read them back.
        secret = os.urandom(32)
        if url is not None:
            _log.warning(
                "response cache in Redis without a key: answers are signed with a key of this "
                "router alone and no other router will use them; give --response-cache-key-file "
                "(or --tier-key-file)"
            )
    store: ResponseStore
    if url is not None:
        store = RedisResponseStore.from_url(
            url,
            config.redis_namespace,
            config.response_cache_ttl_s,
            stats,
            timeout_s=config.response_cache_timeout_s,
        )
    else:
        store = MemoryResponseStore(int(config.response_cache_mb * 2**20), stats)
    return ResponseCache(
        store,
        EntryCodec(secret),
        stats,
        max_entry_bytes=int(config.response_cache_max_entry_kb * 2**10),
        queue_entries=config.response_cache_queue_entries,
    )
