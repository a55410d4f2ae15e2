"""KV events through Redis Streams: the entry encoding (round trip, a pinned entry, malformed
entries), the publisher against a real redis-server (order, trimming, an outage), and routers
sharing one RedisPrefixIndex that apply the same stream in overlapping batches."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from suite_support import wait_for

from cachesvc.bench.local_redis import LocalRedis
from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared, Event
from cachesvc.kv.events_redis import (
    EventStreamConfig,
    StreamPublisher,
    decode_event,
    encode_event,
    stream_key,
)
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.index import IndexSnapshot, MemoryPrefixIndex
from cachesvc.kv.index_redis import RedisPrefixIndex
from cachesvc.kv.types import WorkerId

H = hash_blocks(list(range(48)), 4, root_hash("fp", 4))  # twelve chained hashes
W = WorkerId("worker-0")

EVENTS: list[Event] = [
    BlockStored(0, "hbm", (H[0],), None),
    BlockStored(1, "hbm", (H[1], H[2]), H[0]),
    BlockMoved(2, (H[1],), "hbm", "dram"),
    BlockRemoved(3, "dram", (H[1],)),
    BlockStored(4, "nvme", (), H[3]),
    Cleared(5, "hbm"),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: Event) -> None:
    fields = encode_event("inc-1", event)
    assert all(isinstance(v, str) for v in fields.values())
    assert decode_event(fields) == ("inc-1", event)


def test_entry_format_is_pinned() -> None:
    # Routers and workers of different releases read each other's entries: this must not drift.
    assert stream_key("prod", "worker-3") == "prod:{events}:worker-3"
    assert encode_event("abc", BlockStored(7, "hbm", (H[1], H[2]), H[0])) == {
        "v": "1",
        "inc": "abc",
        "seq": "7",
        "kind": "stored",
        "tier": "hbm",
        "dst": "",
        "parent": H[0].hex(),
        "hashes": f"{H[1].hex()},{H[2].hex()}",
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": "2"}, "format"),
        ({"kind": "evicted"}, "kind"),
        ({"seq": "seven"}, "invalid literal"),
        ({"hashes": "zz"}, "hexadecimal"),
        ({"inc": None}, "lacks field 'inc'"),
    ],
)
def test_malformed_entries_raise_value_error(change: dict[str, str | None], message: str) -> None:
    fields: dict[str, str] = encode_event("inc", EVENTS[1])
    for key, value in change.items():
        if value is None:
            del fields[key]
        else:
            fields[key] = value
    with pytest.raises(ValueError, match=message):
        decode_event(fields)


def test_stream_config_rejects_a_bad_url() -> None:
    with pytest.raises(ValueError, match="redis://"):
        EventStreamConfig("localhost:6379")


# ---- the publisher -------------------------------------------------------------------------------


def _read_all(url: str, key: str) -> list[tuple[str, Event]]:
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    return [decode_event(fields) for _, fields in client.xrange(key)]


def _stream(url: str, maxlen: int = 100_000) -> tuple[EventStreamConfig, str]:
    config = EventStreamConfig(url, f"test-{uuid.uuid4().hex[:8]}", maxlen)
    return config, stream_key(config.namespace, W)


def test_publisher_writes_events_in_order(redis_url: str) -> None:
    config, key = _stream(redis_url)
    publisher = StreamPublisher.from_config(config, W)
    publisher.publish("inc", EVENTS[:2])
    publisher.publish("inc", [])
    publisher.publish("inc", EVENTS[2:])
    assert publisher.close(timeout_s=10)
    assert _read_all(redis_url, key) == [("inc", e) for e in EVENTS]
    assert (publisher.num_published, publisher.num_errors) == (len(EVENTS), 0)


def test_a_closed_stream_expires_until_published_again(redis_url: str) -> None:
    import redis

    config, key = _stream(redis_url)
    config = EventStreamConfig(config.redis_url, config.namespace, closed_ttl_s=120)
    client = redis.Redis.from_url(redis_url)
    publisher = StreamPublisher.from_config(config, W)
    publisher.publish("inc", EVENTS[:1])
    assert publisher.close(timeout_s=10)
    assert 0 < client.ttl(key) <= 120
    again = StreamPublisher.from_config(config, W)  # a restarted worker of the same id
    again.publish("inc-2", EVENTS[1:2])
    assert again.close(timeout_s=10)
    assert 0 < client.ttl(key) <= 120
    kept = StreamPublisher.from_config(EventStreamConfig(redis_url, config.namespace), W)
    kept.publish("inc-3", EVENTS[2:3])
    # Publishing lifts the expiry; the default config (3600 s) then sets it again at close.
    assert kept.close(timeout_s=10) and 120 < client.ttl(key) <= 3600
    live = StreamPublisher.from_config(config, W)
    live.publish("inc-4", EVENTS[3:4])
    deadline = time.monotonic() + 10
    while live.num_published < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.ttl(key) == -1, "a publishing worker's stream must not expire"
    live.close(timeout_s=10)


def test_publisher_trims_the_stream(redis_url: str) -> None:
    config, key = _stream(redis_url, maxlen=100)
    publisher = StreamPublisher.from_config(config, W)
    publisher.publish("inc", [BlockStored(i, "hbm", (H[i % 12],)) for i in range(5000)])
    assert publisher.close(timeout_s=30)
    entries = _read_all(redis_url, key)
    # Approximate trimming keeps at least maxlen entries, and far fewer than were written.
    assert 100 <= len(entries) < 1000
    assert entries[-1][1].seq == 4999


def test_publisher_rides_out_a_redis_outage(own_redis: LocalRedis) -> None:
    config, key = _stream(own_redis.url)
    publisher = StreamPublisher(_client(own_redis.url), key, config.maxlen, retry_s=0.05)
    publisher.publish("inc", EVENTS[:3])
    wait_for(lambda: publisher.num_published == 3, 10, "the first three published")
    own_redis.stop(kill=True)
    publisher.publish("inc", EVENTS[3:])  # never raises, never blocks
    wait_for(lambda: publisher.num_errors > 0, 10, "a failed write")
    own_redis.start()  # same port, empty: what landed before the outage is gone with it
    assert publisher.close(timeout_s=10)
    assert _read_all(own_redis.url, key) == [("inc", e) for e in EVENTS[3:]]


def test_publisher_overflow_drops_the_oldest(own_redis: LocalRedis) -> None:
    _, key = _stream(own_redis.url)
    own_redis.stop(kill=True)
    publisher = StreamPublisher(_client(own_redis.url), key, 1000, max_pending=4, retry_s=0.05)
    publisher.publish("inc", EVENTS)
    wait_for(lambda: publisher.num_dropped == 2, 10, "the two oldest dropped")
    own_redis.start()
    assert publisher.close(timeout_s=10)
    # The first two are lost: a reader sees the stream start at seq 2 and resyncs.
    assert [e.seq for _, e in _read_all(own_redis.url, key)] == [2, 3, 4, 5]


def _client(url: str) -> Any:
    import redis

    return redis.Redis.from_url(url, decode_responses=True, socket_timeout=0.5)


# ---- routers sharing one index apply the same stream ---------------------------------------------


def _random_events(rng: random.Random, num: int) -> list[Event]:
    out: list[Event] = []
    for seq in range(num):
        picked = tuple(rng.sample(H, rng.randint(1, 3)))
        kind = rng.random()
        if kind < 0.55:
            out.append(BlockStored(seq, rng.choice(["hbm", "dram"]), picked))
        elif kind < 0.8:
            out.append(BlockRemoved(seq, rng.choice(["hbm", "dram"]), picked))
        elif kind < 0.95:
            out.append(BlockMoved(seq, picked, "hbm", "dram"))
        else:
            out.append(Cleared(seq, "hbm"))
    return out


def _batches(rng: random.Random, events: Sequence[Event]) -> list[Sequence[Event]]:
    """Overlapping batches covering the stream in order, as one reader may re-read them."""
    out, start = [], 0
    while start < len(events):
        end = min(len(events), start + rng.randint(1, 8))
        out.append(events[max(0, start - rng.randint(0, 3)) : end])
        start = end
    return out


@pytest.mark.parametrize("seed", range(6))
def test_routers_applying_one_stream_agree_with_one_application(redis_url: str, seed: int) -> None:
    rng = random.Random(seed)
    events = _random_events(rng, 60)
    namespace = f"apply-{uuid.uuid4().hex[:8]}"
    routers = [RedisPrefixIndex.from_url(redis_url, namespace) for _ in range(3)]
    routers[0].resync(W, IndexSnapshot("inc", 0, {}))
    # Every router reads the whole stream, in its own batches, interleaved with the others.
    queues = [_batches(rng, events) for _ in routers]
    while any(queues):
        i = rng.choice([i for i, q in enumerate(queues) if q])
        assert routers[i].apply(W, "inc", queues[i].pop(0))
    reference = MemoryPrefixIndex()
    reference.resync(W, IndexSnapshot("inc", 0, {}))
    assert reference.apply(W, "inc", events)
    routers[0].check_integrity()
    assert routers[1].next_seq(W) == len(events)
    for prefix_len in range(1, len(H) + 1):
        assert routers[2].longest_prefix(H[:prefix_len]) == reference.longest_prefix(H[:prefix_len])
    # A batch that skips an event is refused and changes nothing: the router resyncs.
    assert not routers[1].apply(W, "inc", [BlockStored(len(events) + 1, "hbm", (H[0],))])
    assert routers[2].next_seq(W) == len(events)


def test_a_stale_life_in_the_stream_is_refused(redis_url: str) -> None:
    index = RedisPrefixIndex.from_url(redis_url, f"life-{uuid.uuid4().hex[:8]}")
    index.resync(W, IndexSnapshot("new", 3, {"hbm": (H[0],)}))
    assert not index.apply(W, "old", [BlockStored(3, "hbm", (H[1],))])
    assert index.longest_prefix(H[:2]) == {W: index.longest_prefix(H[:1])[W]}
