"""A worker's KV events, collected at step boundaries: kept in a bounded buffer that `poll`
answers from (kept, not drained away, so that several routers can follow one worker), and
handed to the worker's Redis Stream publisher when it has one (`cachesvc/kv/events_redis.py`),
which writes them from its own thread."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

from cachesvc.kv.events import Event

if TYPE_CHECKING:
    from cachesvc.kv.events_redis import StreamPublisher
    from workers.engine.async_engine import AsyncEngine
    from workers.engine.engine import Engine

_MAX_BUFFERED_EVENTS = 65536
_PUBLISH_INTERVAL_S = 0.01  # how often new events are looked for, when a stream is configured
_log = logging.getLogger(__name__)


class EventBuffer:
    """The events of one worker incarnation; touch it on the actor's loop or between steps."""

    def __init__(self, incarnation: str, publisher: StreamPublisher | None) -> None:
        self.incarnation = incarnation
        self.publisher = publisher
        self._events: deque[Event] = deque(maxlen=_MAX_BUFFERED_EVENTS)
        self.next_seq = 0  # of the next event to collect

    def collect(self, engine: Engine) -> None:
        """Take what the engine logged since the last call (between steps only)."""
        events = engine.pool.events.drain()
        self._events.extend(events)
        self.next_seq = engine.pool.events.next_seq
        if self.publisher is not None:
            self.publisher.publish(self.incarnation, events)

    def since(self, since_seq: int) -> tuple[Event, ...]:
        """The kept events numbered `since_seq` and later, oldest first."""
        newer: list[Event] = []
        for event in reversed(self._events):  # newest first: a poll asks for few events
            if event.seq < since_seq:
                break
            newer.append(event)
        return tuple(reversed(newer))

    async def publish_forever(self, engine: AsyncEngine) -> None:
        """Collect new events every few milliseconds, so that they reach the stream without a
        poll; run as a task while there is a publisher."""
        log = engine.engine.pool.events
        while True:
            await asyncio.sleep(_PUBLISH_INTERVAL_S)
            # Reading the counter while a step runs is safe (one int); collecting waits for
            # the step to end, so events leave at most a step plus this interval late.
            if log.next_seq != self.next_seq:
                try:
                    await engine.call(self.collect)
                except Exception:
                    _log.exception("collecting KV events failed")
