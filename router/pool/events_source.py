"""Where a router's KV events come from: Ray polls, or the workers' Redis Streams.

Two implementations of one small interface, picked by `make_event_source` from the config:

- `PolledEvents` (no Redis): every `WorkerActor.poll` carries the events since the index's next
  sequence number; the source itself does nothing.
- `RedisStreamEvents` (`redis_url` set): one task follows every worker's stream with a blocking
  XREAD and hands the events to the pool; polls then bring only load. A worker that does not
  publish to the stream this router expects (started without Redis, or in another namespace) is
  still followed through its polls, so mixed set-ups keep working.

Either way the pool applies events to the index under the worker's lock and resyncs on a gap; the
source only delivers them in order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cachesvc.kv.events import Event
from cachesvc.kv.events_redis import decode_event, stream_key
from cachesvc.kv.types import WorkerId
from router.config import RouterConfig

_log = logging.getLogger(__name__)

# (worker, incarnation, events oldest first) -> applied to the index, resyncing on a gap.
ApplyEvents = Callable[[WorkerId, str, Sequence[Event]], Awaitable[None]]


@dataclass(frozen=True)
class StreamPosition:
    """Where to start following a worker: the index holds its events before `next_seq` of
    this incarnation."""

    incarnation: str
    next_seq: int


class EventSource(Protocol):
    """Delivers the workers' KV events to the pool (polls deliver load either way)."""

    def follows(self, worker: WorkerId, event_stream: str | None) -> bool:
        """True when this source delivers `worker`'s events, given the stream the worker says
        it publishes to (None: it publishes none); its polls then carry no events."""
        ...

    async def start(self, positions: Mapping[WorkerId, StreamPosition], apply: ApplyEvents) -> None:
        """Follow the workers `follows` accepted, from their positions; returns once started."""
        ...

    def forget(self, worker: WorkerId) -> None:
        """Stop following a dead worker; unknown workers are ignored."""
        ...

    async def follow(self, worker: WorkerId, position: StreamPosition, apply: ApplyEvents) -> None:
        """Follow one more worker (a replacement) from `position`, after `start`."""
        ...

    async def close(self) -> None:
        """Stop following; idempotent."""
        ...


class PolledEvents:
    """Events ride on the Ray polls: nothing to follow."""

    def follows(self, worker: WorkerId, event_stream: str | None) -> bool:
        return False

    async def start(self, positions: Mapping[WorkerId, StreamPosition], apply: ApplyEvents) -> None:
        return None

    async def follow(self, worker: WorkerId, position: StreamPosition, apply: ApplyEvents) -> None:
        pass

    def forget(self, worker: WorkerId) -> None:
        return None

    async def close(self) -> None:
        return None


def make_event_source(config: RouterConfig) -> EventSource:
    """Redis Streams when `redis_url` is set, Ray polls otherwise."""
    if config.redis_url is None:
        return PolledEvents()
    return RedisStreamEvents.from_url(config.redis_url, config.redis_namespace)


_COUNT = 512  # entries per stream per XREAD
_BLOCK_MS = 1000  # an XREAD returns at least this often, to pick up a changed worker set
_SCAN_PAGE = 256


class RedisStreamEvents:
    """Follows every worker's stream from one task (`client` is a redis.asyncio client).

    Redis failing is logged, counted in `num_errors` and retried every `retry_s`; the stream
    keeps the entries meanwhile (up to its MAXLEN), so reading resumes where it stopped.
    """

    def __init__(self, client: Any, namespace: str, retry_s: float = 1.0) -> None:
        self.num_errors = 0
        self.num_events = 0
        self._client = client
        self._namespace = namespace
        self._retry_s = retry_s
        self._last_id: dict[WorkerId, str] = {}  # followed worker -> last entry id read
        self._task: asyncio.Task[None] | None = None
        self._last_warning = 0.0

    @classmethod
    def from_url(cls, url: str, namespace: str) -> RedisStreamEvents:
        import redis.asyncio

        # Reads block for up to _BLOCK_MS: the socket must wait longer than that.
        client = redis.asyncio.Redis.from_url(
            url, decode_responses=True, socket_timeout=_BLOCK_MS / 1000 + 5.0
        )
        return cls(client, namespace)

    def follows(self, worker: WorkerId, event_stream: str | None) -> bool:
        return event_stream == stream_key(self._namespace, worker)

    async def start(self, positions: Mapping[WorkerId, StreamPosition], apply: ApplyEvents) -> None:
        for worker, position in positions.items():
            self._last_id[worker] = await self._start_id(worker, position)
        if self._last_id:
            self._task = asyncio.get_running_loop().create_task(self._read_forever(apply))

    def forget(self, worker: WorkerId) -> None:
        self._last_id.pop(worker, None)

    async def follow(self, worker: WorkerId, position: StreamPosition, apply: ApplyEvents) -> None:
        self._last_id[worker] = await self._start_id(worker, position)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._read_forever(apply))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._client.aclose()

    # ---- reading ----------------------------------------------------------------------------

    async def _start_id(self, worker: WorkerId, position: StreamPosition) -> str:
        """The id of the newest entry the index already covers (older life, or a lower
        sequence number), found by paging back from the tail; "0-0" when none is covered."""
        import redis

        key, upper = stream_key(self._namespace, worker), "+"
        try:
            while page := await self._client.xrevrange(key, max=upper, min="-", count=_SCAN_PAGE):
                for entry_id, fields in page:
                    if fields.get("inc") != position.incarnation:
                        return str(entry_id)
                    if int(fields.get("seq", -1)) < position.next_seq:
                        return str(entry_id)
                upper = f"({page[-1][0]}"
        except (redis.RedisError, ValueError) as exc:
            self._error(exc)
        return "0-0"  # read it all: entries the index covers are skipped when applied

    async def _read_forever(self, apply: ApplyEvents) -> None:
        import redis

        while self._last_id:
            keys = {stream_key(self._namespace, w): w for w in self._last_id}
            streams = {k: self._last_id[w] for k, w in keys.items()}
            try:
                reply = await self._client.xread(streams, count=_COUNT, block=_BLOCK_MS)
            except redis.RedisError as exc:
                self._error(exc)
                await asyncio.sleep(self._retry_s)
                continue
            # RESP2 answers a list of [key, entries], RESP3 a dict.
            items = reply.items() if isinstance(reply, dict) else (reply or [])
            for key, entries in items:
                worker = keys[str(key)]
                if worker in self._last_id and entries:  # not forgotten while applying
                    self._last_id[worker] = str(entries[-1][0])
                    await self._deliver(worker, entries, apply)

    async def _deliver(self, worker: WorkerId, entries: Sequence[Any], apply: ApplyEvents) -> None:
        """Apply a worker's entries, one call per run of the same incarnation; an unreadable
        entry is skipped (its sequence number then shows up as a gap)."""
        runs: list[tuple[str, list[Event]]] = []
        for entry_id, fields in entries:
            try:
                incarnation, event = decode_event(fields)
            except ValueError as exc:
                _log.warning("skipping event entry %s of %s: %s", entry_id, worker, exc)
                continue
            if not runs or runs[-1][0] != incarnation:
                runs.append((incarnation, []))
            runs[-1][1].append(event)
        for incarnation, events in runs:
            self.num_events += len(events)
            try:
                await apply(worker, incarnation, events)
            except Exception:  # the reader must outlive any one worker's trouble
                _log.exception("applying events of worker %s failed", worker)

    def _error(self, exc: Exception) -> None:
        self.num_errors += 1
        now = time.monotonic()
        if now - self._last_warning > 10.0:  # one line per outage, not one per read
            self._last_warning = now
            _log.warning("Redis event streams unavailable, index updates wait: %s", exc)
