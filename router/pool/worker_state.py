"""One worker as the router sees it: its handle, health, load, and where its events stand."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any

from cachesvc.kv.types import WorkerId
from workers.protocol import WorkerInfo, WorkerLoad


class Health(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failing; routed to only when no healthy worker is left
    DEAD = "dead"  # gone for good: out of routing and the index until replaced


@dataclass
class WorkerState:
    """One worker's handle and what the router knows about it; mutated by the pool only (its
    event position by the pool's `IndexSync`)."""

    worker_id: WorkerId
    actor: Any
    info: WorkerInfo | None = None
    health: Health = Health.HEALTHY
    load: WorkerLoad = field(default_factory=WorkerLoad)
    missed_polls: int = 0  # pings unanswered in a row
    stalled_s: float = 0.0  # as its last answered ping said (`Heartbeat.stalled_s`)
    failing_since: float | None = None  # monotonic time it became unhealthy
    num_replacements: int = 0
    # Requests this router has sent and not yet seen finish, and their prompt tokens not yet
    # prefilled: fresher than the polled load.
    num_inflight: int = 0
    num_inflight_tokens: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    incarnation: str = ""  # the life of the worker the index follows
    # Events through the event source (not the polls); the index holds those before
    # `stream_seq`; `advanced` is set, and replaced, whenever `stream_seq` moves.
    streamed: bool = False
    stream_seq: int = 0
    stream_lagging: bool = False
    advanced: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def num_requests(self) -> int:
        return max(self.load.num_running + self.load.num_waiting, self.num_inflight)

    @property
    def num_queued_tokens(self) -> int:
        return max(self.load.num_queued_tokens, self.num_inflight_tokens)
