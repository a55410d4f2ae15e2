"""`PrefixIndex` in Redis, so several routers share one view and a restarted router is not blind.

The same semantics as `MemoryPrefixIndex`, kept by Lua scripts so that every call is one round
trip and atomic: routers that follow the same worker (through its polls or its Redis Stream)
apply the same events concurrently, and the per-worker sequence number stored next to the entries
makes a repeat a no-op and a gap a resync, so they keep one consistent copy. Keys (all under one
hash tag, so a Redis Cluster keeps them in one slot):

    {ns}:{index}:h:<hash hex>   hash  worker -> bitmask of the tiers holding the block
    {ns}:{index}:w:<worker>     set   hash hexes the worker holds
    {ns}:{index}:s:<worker>     hash  incarnation, next_seq
    {ns}:{index}:workers        set   workers with a stream
    {ns}:{index}:purge-epoch    int   purges so far (the routers' shared purge epoch)

Redis failing never raises into the request path: a lookup answers "nothing cached", updates are
dropped (the stored sequence number does not move, so a poll fetches the events again once Redis
is back, and a stream's next event shows a gap and resyncs) and `num_errors` counts them. The
purge epoch fails closed: unread (Redis failing, or skipped by the open breaker) it raises
`PurgeEpochUnknown`, and the router gives that request a salt of its own, since another router
may have purged the epoch last read here. Starting a purge epoch raises too: a purge must not
report success while the routers go on hashing under the old epoch. Calls are synchronous: on
a loopback or in-zone Redis a round trip is well under a millisecond, cheaper than an executor
hop.
The request path's reads never connect (a slow handshake would fail each one, the epoch unknown
for good): their connection is opened off it (`cachesvc.kv.redis_client.PreconnectedClient`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from cachesvc.kv.breaker import CircuitBreaker
from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared, Event
from cachesvc.kv.index import TIER_ORDER, IndexSnapshot, PrefixMatch, PurgeEpochUnknown
from cachesvc.kv.index_redis_scripts import APPLY, DROP, LOOKUP, RESYNC
from cachesvc.kv.redis_client import PreconnectedClient, redis_client
from cachesvc.kv.types import BlockHash, WorkerId

_log = logging.getLogger(__name__)
# The request path's reads (a prompt's prefix, the purge epoch) give Redis this long, on the
# router's event loop; updates from the workers' events (a resync's script can be long) get
# UPDATE_TIMEOUT_S, on that loop too.
LOOKUP_TIMEOUT_S = 0.05
UPDATE_TIMEOUT_S = 0.25
CONNECT_TIMEOUT_S = 2.0  # the reads' connect with its handshake, off the request path
_MAX_FAILURES = 3  # failures in a row that open the breaker
_COOLDOWN_S = 5.0  # then one probe every this often


def _tier_bit(tier: str) -> int:
    if tier not in TIER_ORDER:
        raise ValueError(f"unknown tier {tier!r}; the Redis index knows {TIER_ORDER}")
    return 1 << TIER_ORDER.index(tier)


def _encode_event(event: Event) -> list[Any]:
    if isinstance(event, BlockStored):
        return [event.seq, "S", _tier_bit(event.tier), 0, [h.hex() for h in event.block_hashes]]
    if isinstance(event, BlockRemoved):
        return [event.seq, "R", _tier_bit(event.tier), 0, [h.hex() for h in event.block_hashes]]
    if isinstance(event, BlockMoved):
        hexes = [h.hex() for h in event.block_hashes]
        return [event.seq, "M", _tier_bit(event.src_tier), _tier_bit(event.dst_tier), hexes]
    assert isinstance(event, Cleared)
    return [event.seq, "C", _tier_bit(event.tier), 0, []]


def _json(value: Any) -> str:
    # cjson decodes an empty JSON array as an empty table either way; no special case needed.
    return json.dumps(value, separators=(",", ":"))


class RedisPrefixIndex:
    """`PrefixIndex` kept in Redis; every method is one round trip.

    `namespace` separates deployments sharing one Redis: routers of the same workers must use
    the same namespace, and two deployments whose worker ids overlap must not.
    """

    def __init__(
        self,
        client: Any,
        namespace: str = "cachesvc",
        lookups: PreconnectedClient | None = None,
        breaker: CircuitBreaker | None = None,
    ) -> None:
        """`client` makes every call but the request path's reads, which go through
        `lookups` when given (its connects paced by `breaker`), else through `client`."""
        self._client = client
        # The reads every request makes (its prefix, the purge epoch) go through a client with a
        # short timeout, and every call through one breaker: a Redis that stops answering costs
        # a few timeouts, then none until a probe, however many requests arrive (these calls
        # run on the router's event loop).
        self._breaker = breaker or CircuitBreaker(_MAX_FAILURES, _COOLDOWN_S)
        self._lookups = lookups
        self.num_skipped = 0  # calls not made: the breaker open, or the reads not connected
        self._prefix = f"{namespace}:{{index}}:"
        self._apply = client.register_script(APPLY)
        self._resync = client.register_script(RESYNC)
        self._drop = client.register_script(DROP)
        self._lookup = client.register_script(LOOKUP)
        self._known_seq: dict[WorkerId, int | None] = {}
        self._known_epoch = 0
        self.num_epoch_unknown = 0
        self.num_errors = 0
        self._last_warning = 0.0

    @classmethod
    def from_url(cls, url: str, namespace: str = "cachesvc") -> RedisPrefixIndex:
        """Connect to `url` (redis://host:port/db); raises ConnectionError when it is not
        reachable, so a misconfigured router fails at start rather than routing blind."""
        import redis

        # No retries with backoff: a router must not stall its requests on a Redis outage.
        client = redis_client(url, UPDATE_TIMEOUT_S, decode_responses=True)
        try:
            client.ping()
        except redis.RedisError as exc:
            raise ConnectionError(f"--redis-url {url}: Redis is not reachable: {exc}") from exc
        name = "Redis prefix index lookups"
        lookups = PreconnectedClient(
            url, LOOKUP_TIMEOUT_S, CONNECT_TIMEOUT_S, name, decode_responses=True
        )
        index = cls(client, namespace, lookups=lookups)
        index.connect_lookups()  # open for the first requests, if it opens in time
        return index

    def connect_lookups(self) -> bool:
        """Open the request path's connection now (paced by the breaker), or wait for the
        attempt under way (at most CONNECT_TIMEOUT_S); whether it is open. Blocks: for start-up
        and tests; the request path's reads start attempts in the background themselves."""
        return self._lookups is None or self._lookups.connect(self._breaker)

    @property
    def lookups_up(self) -> bool:
        """Whether the request path's reads have a connection to Redis open."""
        return self._lookups is None or self._lookups.up

    # ---- updates ----------------------------------------------------------------------------

    def apply(self, worker: WorkerId, incarnation: str, events: Sequence[Event]) -> bool:
        args = [self._prefix, worker, incarnation, _json([_encode_event(e) for e in events])]
        result = self._call(self._apply, args, default=1)
        return bool(result)

    def resync(self, worker: WorkerId, snapshot: IndexSnapshot) -> None:
        blocks = [[_tier_bit(t), [h.hex() for h in hs]] for t, hs in snapshot.blocks.items()]
        args = [self._prefix, worker, snapshot.incarnation, snapshot.next_seq, _json(blocks)]
        self._call(self._resync, args, default=0)

    def drop_worker(self, worker: WorkerId) -> None:
        self._call(self._drop, [self._prefix, worker], default=0)
        self._known_seq.pop(worker, None)

    # ---- queries ----------------------------------------------------------------------------

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> dict[WorkerId, PrefixMatch]:
        if not hashes:
            return {}
        args = [self._prefix, len(TIER_ORDER), *(h.hex() for h in hashes)]
        try:
            flat = self._read(lambda client: self._lookup(keys=[], args=args, client=client))
        except ConnectionError:
            flat = []
        width = len(TIER_ORDER) + 1
        out: dict[WorkerId, PrefixMatch] = {}
        for i in range(0, len(flat), width):
            worker = WorkerId(flat[i])
            counts = [int(c) for c in flat[i + 1 : i + width]]
            per_tier = {tier: c for tier, c in zip(TIER_ORDER, counts, strict=True) if c}
            out[worker] = PrefixMatch(worker, sum(counts), per_tier)
        return out

    def num_blocks(self, worker: WorkerId) -> int:
        return int(self._run(lambda: self._client.scard(f"{self._prefix}w:{worker}"), default=0))

    def next_seq(self, worker: WorkerId) -> int | None:
        # On a Redis error, the last value read: asking the worker again for events the index
        # already has is harmless, asking from zero would ship its whole event buffer.
        raw = self._run(
            lambda: self._client.hget(f"{self._prefix}s:{worker}", "next_seq"),
            default=self._known_seq.get(worker),
        )
        value = None if raw is None else int(raw)
        self._known_seq[worker] = value
        return value

    def purge_epoch(self) -> int:
        # Read on every request: another router's purge must take effect at once here too.
        # Never the last value read instead: a purge through another router may have ended it.
        key = f"{self._prefix}purge-epoch"
        try:
            raw = self._read(lambda client: client.get(key))
        except ConnectionError as exc:
            self.num_epoch_unknown += 1
            raise PurgeEpochUnknown(f"Redis prefix index: purge epoch unknown: {exc}") from exc
        if raw is not None:
            # The highest seen: a Redis that lost the key must not bring purged epochs back.
            self._known_epoch = max(self._known_epoch, int(raw))
        return self._known_epoch

    def advance_purge_epoch(self) -> int:
        import redis

        try:
            epoch = int(self._client.incr(f"{self._prefix}purge-epoch"))
        except redis.RedisError as exc:
            self.num_errors += 1
            raise ConnectionError(f"Redis prefix index: cannot start a purge epoch: {exc}") from exc
        self._known_epoch = max(self._known_epoch, epoch)
        return epoch

    def workers(self) -> list[WorkerId]:
        """Workers with a live event stream, in sorted order."""
        members = self._run(lambda: self._client.smembers(f"{self._prefix}workers"), default=())
        return sorted(WorkerId(w) for w in members)

    def check_integrity(self) -> None:
        """Raise AssertionError if the hash entries and the worker sets disagree (scans every
        key of the namespace: for tests)."""
        client, p = self._client, self._prefix
        for key in client.scan_iter(match=f"{p}h:*"):
            holders = client.hgetall(key)
            assert holders, "a hash with no holder is kept"
            for worker, mask in holders.items():
                assert int(mask) != 0, "a worker entry with no tier is kept"
                assert client.sismember(f"{p}w:{worker}", key[len(p) + 2 :]), "set is missing"
        for key in client.scan_iter(match=f"{p}w:*"):
            worker = key[len(p) + 2 :]
            for hex_hash in client.smembers(key):
                assert client.hexists(f"{p}h:{hex_hash}", worker), "hash entry is missing"

    # ---- errors -----------------------------------------------------------------------------

    def _call(self, script: Any, args: list[Any], default: Any) -> Any:
        return self._run(lambda: script(keys=[], args=args), default)

    def _run(self, fn: Any, default: Any) -> Any:
        try:
            return self._checked(fn)
        except ConnectionError:
            return default

    def _read(self, fn: Any) -> Any:
        """`fn(client)` on the request path's connection, through `_checked`; also raises
        ConnectionError, at once, while that connection is not open (its opening then starts
        in the background)."""
        client = self._client if self._lookups is None else self._lookups.client(self._breaker)
        if client is None:
            self.num_skipped += 1
            raise ConnectionError("skipped: the lookup connection to Redis is not open yet")
        return self._checked(lambda: fn(client), lookup=True)

    def _checked(self, fn: Any, lookup: bool = False) -> Any:
        """`fn()` through the breaker; raises ConnectionError when the breaker skips it or
        Redis fails (counted, logged once per outage; a failed `lookup` drops its connection).
        Any other exception is raised as it is, and counts as a failure: a half-open breaker
        waits for its probe's outcome."""
        import redis

        if not self._breaker.allow():
            self.num_skipped += 1
            raise ConnectionError("skipped: Redis failed recently (circuit breaker open)")
        try:
            result = fn()
        except redis.RedisError as exc:
            self._breaker.failed()
            self.num_errors += 1
            if lookup and self._lookups is not None:
                self._lookups.lost()  # redis-py closed it; a lookup must not reopen it
            now = time.monotonic()
            if now - self._last_warning > 10.0:  # one line per outage, not one per call
                self._last_warning = now
                _log.warning(
                    "Redis prefix index unavailable: routing without it, and requests reuse "
                    "no cached block until it answers (the purge epoch is unknown): %s",
                    exc,
                )
            raise ConnectionError(str(exc)) from exc
        except BaseException:
            self._breaker.failed()
            raise
        self._breaker.succeeded()
        return result
