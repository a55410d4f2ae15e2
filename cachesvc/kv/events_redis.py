"""KV events through Redis Streams: one stream per worker, one entry per event.

The worker publishes (`StreamPublisher`, a background thread), the routers read (`router/
events_source.py`). Key and entry format, shared by both sides:

    <namespace>:{events}:<worker>    stream, XADD with an approximate MAXLEN

    v        format version ("1")
    inc      the worker's incarnation (one life of its process)
    seq      the event's per-worker sequence number
    kind     stored | removed | moved | cleared
    tier     the tier (the source tier of a move)
    dst      the destination tier of a move, else ""
    parent   hex hash before the first block of a `stored`, else ""
    hashes   hex block hashes, comma-joined

Plain strings, never pickle: any router version (or `redis-cli`) reads them. The `{events}` hash
tag keeps every worker's stream in one Redis Cluster slot, so one XREAD follows them all.

Losing an entry is never silent: the reader sees a gap in `seq` and resyncs the worker from a
snapshot, so trimming (MAXLEN), a Redis outage and a publisher overflow all end the same way.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachesvc.kv.config import ConfigError
from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared, Event
from cachesvc.kv.redis_client import redis_client
from cachesvc.kv.types import BlockHash

_log = logging.getLogger(__name__)

STREAM_FORMAT = "1"
_KINDS = ("stored", "removed", "moved", "cleared")


def stream_key(namespace: str, worker_id: str) -> str:
    """The stream a worker publishes to; routers of one deployment share `namespace`."""
    return f"{namespace}:{{events}}:{worker_id}"


@dataclass(frozen=True)
class EventStreamConfig:
    """Where a worker publishes its events: a Redis URL and the deployment's namespace.

    `maxlen` bounds each stream (trimmed approximately): a router that falls further behind
    than that resyncs from a snapshot. A worker that closes leaves its stream to expire after
    `closed_ttl_s` (time for the last readers to see its final events; None: kept), so ended
    deployments leave no streams behind; publishing again lifts the expiry.
    """

    redis_url: str
    namespace: str = "cachesvc"
    maxlen: int = 100_000
    closed_ttl_s: int | None = 3600

    def __post_init__(self) -> None:
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"event stream url must look like redis://host:port/db, got {self.redis_url!r}"
            )
        if self.maxlen < 1:
            raise ConfigError(f"event stream maxlen must be positive, got {self.maxlen}")
        if self.closed_ttl_s is not None and self.closed_ttl_s < 1:
            raise ConfigError(
                f"event stream closed_ttl_s must be positive or None, got {self.closed_ttl_s}"
            )


# ---- encoding ------------------------------------------------------------------------------------


def encode_event(incarnation: str, event: Event) -> dict[str, str]:
    """The stream entry of one event (every field a string)."""
    fields = {
        "v": STREAM_FORMAT,
        "inc": incarnation,
        "seq": str(event.seq),
        "dst": "",
        "parent": "",
    }
    if isinstance(event, BlockStored):
        parent = "" if event.parent is None else event.parent.hex()
        fields |= {"kind": "stored", "tier": event.tier, "parent": parent}
    elif isinstance(event, BlockRemoved):
        fields |= {"kind": "removed", "tier": event.tier}
    elif isinstance(event, BlockMoved):
        fields |= {"kind": "moved", "tier": event.src_tier, "dst": event.dst_tier}
    else:
        assert isinstance(event, Cleared)
        fields |= {"kind": "cleared", "tier": event.tier}
    hashes = () if isinstance(event, Cleared) else event.block_hashes
    fields["hashes"] = ",".join(h.hex() for h in hashes)
    return fields


def decode_event(fields: Mapping[str, str]) -> tuple[str, Event]:
    """(incarnation, event) of a stream entry; ValueError names what is wrong with it."""
    try:
        version, incarnation, kind = fields["v"], fields["inc"], fields["kind"]
        seq, tier = int(fields["seq"]), fields["tier"]
        hashes = _hashes(fields["hashes"])
        parent_hex, dst = fields.get("parent", ""), fields.get("dst", "")
    except KeyError as exc:
        raise ValueError(f"event entry lacks field {exc}") from exc
    if version != STREAM_FORMAT:
        raise ValueError(f"event entry format {version!r}; this reader knows {STREAM_FORMAT!r}")
    if kind == "stored":
        parent = BlockHash(bytes.fromhex(parent_hex)) if parent_hex else None
        return incarnation, BlockStored(seq, tier, hashes, parent)
    if kind == "removed":
        return incarnation, BlockRemoved(seq, tier, hashes)
    if kind == "moved":
        return incarnation, BlockMoved(seq, hashes, tier, dst)
    if kind == "cleared":
        return incarnation, Cleared(seq, tier)
    raise ValueError(f"event entry kind {kind!r}; expected one of {_KINDS}")


def _hashes(joined: str) -> tuple[BlockHash, ...]:
    return tuple(BlockHash(bytes.fromhex(h)) for h in joined.split(",") if h)


# ---- publishing ----------------------------------------------------------------------------------

_BATCH = 512  # entries per pipeline round trip
_STOP = None


class StreamPublisher:
    """Publishes one worker's events to its stream from a background thread.

    `publish` never blocks and never raises: the engine's loop hands over its events and goes
    on. The thread sends them in pipelined batches; when Redis fails it counts the error, keeps
    up to `max_pending` entries and retries every `retry_s` (a longer outage drops the oldest:
    the routers see the gap and resync). A retried batch may repeat entries that did land:
    readers skip sequence numbers they already applied.
    """

    def __init__(
        self,
        client: Any,
        key: str,
        maxlen: int,
        max_pending: int = 65536,
        retry_s: float = 1.0,
        closed_ttl_s: int | None = None,
    ) -> None:
        self.key = key
        self.closed_ttl_s = closed_ttl_s
        self.num_published = 0
        self.num_errors = 0
        self.num_dropped = 0
        self._client = client
        self._maxlen = maxlen
        self._max_pending = max_pending
        self._retry_s = retry_s
        self._queue: queue.SimpleQueue[list[dict[str, str]] | None] = queue.SimpleQueue()
        self._pending: deque[dict[str, str]] = deque()
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EventStreamConfig, worker_id: str) -> StreamPublisher:
        """A publisher for `worker_id`; connects lazily, so a Redis that is down at start only
        delays the events."""
        # The thread retries whole batches itself.
        client = redis_client(config.redis_url, 2.0, decode_responses=True)
        key = stream_key(config.namespace, worker_id)
        return cls(client, key, config.maxlen, closed_ttl_s=config.closed_ttl_s)

    def publish(self, incarnation: str, events: Sequence[Event]) -> None:
        """Queue events (oldest first) for the stream; returns at once."""
        if events:
            self._queue.put([encode_event(incarnation, e) for e in events])

    def close(self, timeout_s: float = 10.0) -> bool:
        """Send what is queued (one try when Redis is down), stop the thread, let the stream
        expire after `closed_ttl_s` and close the client; False when the thread did not finish
        within `timeout_s`."""
        import redis

        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        if self.closed_ttl_s is not None:
            try:
                self._client.expire(self.key, self.closed_ttl_s)
            except redis.RedisError as exc:
                _log.warning("cannot set the expiry of %s: %s", self.key, exc)
        self._client.close()
        return True

    # ---- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        stopping = failed = False
        while True:
            wait: float | None = None  # nothing pending: sleep until something arrives
            if self._pending:
                wait = self._retry_s if failed else 0.0
            stopping = self._take(wait) or stopping
            if self._pending:
                failed = not self._send()
            if stopping and (failed or not self._pending):
                return

    def _take(self, wait: float | None) -> bool:
        """Move queued batches to the pending entries; True once the stop mark was seen."""
        stop = False
        try:
            item = self._queue.get(timeout=wait) if wait != 0.0 else self._queue.get_nowait()
            while True:
                if item is _STOP:
                    stop = True
                else:
                    self._pending.extend(item)
                item = self._queue.get_nowait()
        except queue.Empty:
            pass
        overflow = len(self._pending) - self._max_pending
        for _ in range(max(0, overflow)):
            self._pending.popleft()
        self.num_dropped += max(0, overflow)
        return stop

    def _send(self) -> bool:
        import redis

        batch = [self._pending[i] for i in range(min(_BATCH, len(self._pending)))]
        pipe = self._client.pipeline(transaction=False)
        for fields in batch:
            pipe.xadd(self.key, fields, maxlen=self._maxlen, approximate=True)
        pipe.persist(self.key)  # a worker publishing again (restarted) keeps its stream
        try:
            pipe.execute()
        except redis.RedisError as exc:
            self.num_errors += 1
            now = time.monotonic()
            if now - self._last_warning > 10.0:  # one line per outage, not one per batch
                self._last_warning = now
                _log.warning("cannot publish KV events to Redis %s, retrying: %s", self.key, exc)
            return False
        for _ in batch:
            self._pending.popleft()
        self.num_published += len(batch)
        return True
