"""The response cache: a deterministic request's complete answer, returned without a worker.

When a request is fully deterministic (greedy, beam search, or sampling with an explicit seed),
the cheapest answer is the one already given: `key(prompt + sampling + tenant + model) ->
answer`. Only answers that finished normally are stored (every sample ended with "stop" or
"length"), never a cancelled or failed stream.

The key is a keyed BLAKE2b of everything that determines the output: the tenant's cache salt,
the model fingerprint, the prompt's token ids and every sampling parameter. Entries are stored
in a versioned, checksummed format (a damaged entry is a miss), in memory (an LRU bounded in
bytes) or in Redis (shared by routers, with a TTL); a Redis that fails is a miss, never an
error.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import json
import logging
import struct
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from router.config import RouterConfig
from workers.protocol import StreamDelta, Usage
from workers.sampling_params import SamplingParams

_log = logging.getLogger(__name__)
_MAGIC = b"CSRC"
_VERSION = 1
_HEADER = struct.Struct("<4sBQ")  # magic, version, xxh3-64 of the payload
_KEY_TAG = b"cachesvc/response/v1"
FINISHED = ("stop", "length")


def is_deterministic(params: SamplingParams) -> bool:
    """Whether the same request always gets the same answer: greedy, beam search, or a seed."""
    return params.temperature == 0 or params.beam_width > 1 or params.seed is not None


def response_key(
    model_fingerprint: str,
    cache_salt: str | None,
    prompt_ids: Sequence[int],
    params: SamplingParams,
) -> bytes:
    """The cache key of a request (16 bytes): the tenant's salt keys the hash, so two tenants
    never share an entry even for the same prompt."""
    ids = array.array("I", prompt_ids)
    if sys.byteorder == "big":
        ids.byteswap()
    sampling = json.dumps(dataclasses.asdict(params), sort_keys=True, default=list)
    digest = hashlib.blake2b(digest_size=16, key=(cache_salt or "").encode()[:64])
    for part in (_KEY_TAG, model_fingerprint.encode(), sampling.encode(), ids.tobytes()):
        digest.update(struct.pack("<Q", len(part)))
        digest.update(part)
    return digest.digest()


@dataclass(frozen=True)
class CachedSample:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage


@dataclass(frozen=True)
class CachedResponse:
    """A complete answer: one entry per sample, in sample order."""

    samples: tuple[CachedSample, ...]

    def deltas(self, ttft_ms: float) -> list[StreamDelta]:
        """The answer as a stream: one final delta per sample; its usage says where it came
        from (no prompt token computed or fetched, no worker)."""
        out = []
        for index, sample in enumerate(self.samples):
            usage = dataclasses.replace(
                sample.usage,
                cached_tokens={},
                computed_tokens=0,
                ttft_ms=ttft_ms,
                decode_tokens_per_s=None,
                worker_id="",
                from_response_cache=True,
            )
            delta = StreamDelta(index, sample.token_ids, sample.text, sample.finish_reason, usage)
            out.append(delta)
        return out

    def encode(self) -> bytes:
        payload = json.dumps(
            [
                [list(s.token_ids), s.text, s.finish_reason, dataclasses.asdict(s.usage)]
                for s in self.samples
            ],
            separators=(",", ":"),
        ).encode()
        return _HEADER.pack(_MAGIC, _VERSION, xxhash.xxh3_64_intdigest(payload)) + payload

    @classmethod
    def decode(cls, blob: bytes) -> CachedResponse | None:
        """The entry in `blob`; None when it is damaged or of another version."""
        if len(blob) < _HEADER.size:
            return None
        magic, version, checksum = _HEADER.unpack_from(blob)
        payload = blob[_HEADER.size :]
        if magic != _MAGIC or version != _VERSION:
            return None
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            return None
        try:
            samples = tuple(
                CachedSample(tuple(ids), text, reason, Usage(**usage))
                for ids, text, reason, usage in json.loads(payload)
            )
        except (ValueError, TypeError):
            return None
        return cls(samples)


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
        """The answer, or None unless every sample finished normally."""
        samples = []
        for tokens, text, final in zip(self._tokens, self._text, self._final, strict=True):
            if final is None or final[0] not in FINISHED:
                return None
            samples.append(CachedSample(tuple(tokens), "".join(text), final[0], final[1]))
        return CachedResponse(tuple(samples))


class ResponseStore(Protocol):
    """Where entries live. `get` of a missing or unreadable entry is None; no method raises."""

    async def get(self, key: bytes) -> bytes | None: ...

    async def put(self, key: bytes, blob: bytes) -> None: ...

    async def clear(self) -> int: ...


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    evictions: int = 0
    errors: int = 0
    bytes: int = 0
    entries: int = 0


class MemoryResponseStore:
    """An LRU bounded in bytes (keys and values counted)."""

    def __init__(self, max_bytes: int, stats: StoreStats) -> None:
        self.max_bytes = max_bytes
        self.stats = stats
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()

    async def get(self, key: bytes) -> bytes | None:
        blob = self._entries.get(key)
        if blob is not None:
            self._entries.move_to_end(key)
        return blob

    async def put(self, key: bytes, blob: bytes) -> None:
        size = len(key) + len(blob)
        if size > self.max_bytes:
            return  # larger than the whole cache: not worth evicting everything for
        old = self._entries.pop(key, None)
        if old is not None:
            self.stats.bytes -= len(key) + len(old)
        while self._entries and self.stats.bytes + size > self.max_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self.stats.bytes -= len(evicted_key) + len(evicted)
            self.stats.evictions += 1
        self._entries[key] = blob
        self.stats.bytes += size
        self.stats.entries = len(self._entries)

    async def clear(self) -> int:
        dropped = len(self._entries)
        self._entries.clear()
        self.stats.bytes, self.stats.entries = 0, 0
        return dropped


class RedisResponseStore:
    """Entries in Redis under `<namespace>:response:<key hex>`, each with a TTL (Redis evicts
    by its own policy; this router counts no evictions). Any Redis error is a miss."""

    def __init__(self, client: Any, namespace: str, ttl_s: float, stats: StoreStats) -> None:
        self._client = client
        self._prefix = f"{namespace}:response:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self.stats = stats
        self._last_warning = 0.0

    @classmethod
    def from_url(
        cls, url: str, namespace: str, ttl_s: float, stats: StoreStats, timeout_s: float = 0.2
    ) -> RedisResponseStore:
        import redis.asyncio

        client = redis.asyncio.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        return cls(client, namespace, ttl_s, stats)

    async def get(self, key: bytes) -> bytes | None:
        try:
            blob = await self._client.get(self._prefix + key.hex())
        except Exception as exc:  # redis errors, timeouts: a miss
            self._error(exc)
            return None
        return None if blob is None else bytes(blob)

    async def put(self, key: bytes, blob: bytes) -> None:
        try:
            await self._client.set(self._prefix + key.hex(), blob, px=self._ttl_ms)
        except Exception as exc:
            self._error(exc)

    async def clear(self) -> int:
        dropped = 0
        try:
            async for name in self._client.scan_iter(match=self._prefix + "*", count=500):
                dropped += int(await self._client.delete(name))
        except Exception as exc:
            self._error(exc)
        return dropped

    def _error(self, exc: Exception) -> None:
        self.stats.errors += 1
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # one line per outage
            self._last_warning = now
            _log.warning("response cache in Redis unavailable (a miss): %s", exc)


@dataclass
class ResponseCache:
    """The cache the router consults; `store` decides where entries live."""

    store: ResponseStore
    stats: StoreStats = field(default_factory=StoreStats)

    async def get(self, key: bytes) -> CachedResponse | None:
        blob = await self.store.get(key)
        response = None if blob is None else CachedResponse.decode(blob)
        if response is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return response

    async def put(self, key: bytes, response: CachedResponse) -> None:
        await self.store.put(key, response.encode())
        self.stats.stores += 1

    async def clear(self) -> int:
        """Drop every entry; returns how many (as far as the store can tell)."""
        return await self.store.clear()


def make_response_cache(config: RouterConfig) -> ResponseCache | None:
    """The cache the config asks for: None when `response_cache_mb` is 0; in Redis when the
    router shares its index there (`redis_url`), else in memory."""
    if config.response_cache_mb <= 0:
        return None
    stats = StoreStats()
    store: ResponseStore
    if config.redis_url is not None:
        store = RedisResponseStore.from_url(
            config.redis_url, config.redis_namespace, config.response_cache_ttl_s, stats
        )
    else:
        store = MemoryResponseStore(int(config.response_cache_mb * 2**20), stats)
    return ResponseCache(store, stats)
