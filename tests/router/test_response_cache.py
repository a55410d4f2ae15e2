"""The response cache's parts: keys, the entry format, the memory LRU, the Redis store."""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest

from router.response_cache import (
    CachedResponse,
    CachedSample,
    MemoryResponseStore,
    RedisResponseStore,
    ResponseCache,
    ResponseCollector,
    StoreStats,
    is_deterministic,
    response_key,
)
from workers.protocol import StreamDelta, Usage
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
USAGE = Usage(3, 2, {"hbm": 2}, 1, 5.0, 100.0, "worker-0")
ANSWER = CachedResponse((CachedSample((5, 6), "hi", "length", USAGE),))


def test_only_deterministic_requests_are_cacheable() -> None:
    assert is_deterministic(GREEDY)
    assert is_deterministic(SamplingParams(temperature=0.9, seed=7))
    assert is_deterministic(SamplingParams(temperature=0.9, beam_width=2))
    assert not is_deterministic(SamplingParams(temperature=0.9))


def test_every_input_of_the_output_changes_the_key() -> None:
    base = response_key("fp", "tenant:a", [1, 2, 3], GREEDY)
    assert base == response_key("fp", "tenant:a", [1, 2, 3], GREEDY)
    others = [
        response_key("fp2", "tenant:a", [1, 2, 3], GREEDY),
        response_key("fp", "tenant:b", [1, 2, 3], GREEDY),
        response_key("fp", None, [1, 2, 3], GREEDY),
        response_key("fp", "tenant:a", [1, 2, 4], GREEDY),
        response_key("fp", "tenant:a", [1, 2, 3], dataclasses.replace(GREEDY, max_tokens=5)),
        response_key("fp", "tenant:a", [1, 2, 3], dataclasses.replace(GREEDY, stop=("x",))),
        response_key("fp", "tenant:a", [1, 2, 3], dataclasses.replace(GREEDY, ignore_eos=True)),
        response_key("fp", "tenant:a", [1, 2, 3], dataclasses.replace(GREEDY, output_offset=1)),
    ]
    assert len({base, *others}) == len(others) + 1


def test_entries_round_trip_and_damage_is_a_miss() -> None:
    blob = ANSWER.encode()
    assert CachedResponse.decode(blob) == ANSWER
    flipped = bytearray(blob)
    flipped[-3] ^= 1
    assert CachedResponse.decode(bytes(flipped)) is None
    assert CachedResponse.decode(blob[:10]) is None
    assert CachedResponse.decode(b"XXXX" + blob[4:]) is None


def test_a_hit_streams_the_answer_and_says_so() -> None:
    [delta] = ANSWER.deltas(ttft_ms=0.5)
    assert (delta.token_ids, delta.text, delta.finish_reason) == ((5, 6), "hi", "length")
    assert delta.usage is not None and delta.usage.from_response_cache
    assert delta.usage.cached_tokens == {} and delta.usage.computed_tokens == 0
    assert delta.usage.worker_id == "" and delta.usage.prompt_tokens == 3


def test_only_normally_finished_answers_are_collected() -> None:
    collector = ResponseCollector(2)
    collector.add(StreamDelta(0, (1,), "a"))
    collector.add(StreamDelta(0, (2,), "b", "stop", USAGE))
    assert collector.result() is None  # sample 1 never finished
    collector.add(StreamDelta(1, (3,), "c", "abort", USAGE))
    assert collector.result() is None  # an aborted sample is no answer
    ok = ResponseCollector(1)
    ok.add(StreamDelta(0, (1,), "a"))
    ok.add(StreamDelta(0, (2,), "b", "length", USAGE))
    assert ok.result() == CachedResponse((CachedSample((1, 2), "ab", "length", USAGE),))


def test_the_memory_store_is_an_lru_bounded_in_bytes() -> None:
    stats = StoreStats()
    blob = ANSWER.encode()
    store = MemoryResponseStore(max_bytes=2 * (16 + len(blob)), stats=stats)
    cache = ResponseCache(store, stats)

    async def run() -> None:
        keys = [bytes([i]) * 16 for i in range(3)]
        await cache.put(keys[0], ANSWER)
        await cache.put(keys[1], ANSWER)
        assert await cache.get(keys[0]) == ANSWER  # now the most recent
        await cache.put(keys[2], ANSWER)  # evicts keys[1]
        assert await cache.get(keys[1]) is None
        assert await cache.get(keys[2]) == ANSWER
        assert stats.evictions == 1 and stats.entries == 2
        assert stats.bytes <= store.max_bytes
        assert await cache.clear() == 2 and stats.bytes == 0

    asyncio.run(run())
    assert stats.hits == 2 and stats.misses == 1


def test_the_redis_store_shares_entries_and_an_outage_is_a_miss(redis_url: str) -> None:
    async def run() -> None:
        stats = StoreStats()
        one = ResponseCache(RedisResponseStore.from_url(redis_url, "rc-test", 60, stats), stats)
        two = ResponseCache(RedisResponseStore.from_url(redis_url, "rc-test", 60, stats), stats)
        await one.put(b"k" * 16, ANSWER)
        assert await two.get(b"k" * 16) == ANSWER  # another router sees it
        assert await two.clear() == 1
        assert await one.get(b"k" * 16) is None

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
        down_stats = StoreStats()
        down = ResponseCache(RedisResponseStore.from_url(dead, "rc", 60, down_stats), down_stats)
        await down.put(b"k" * 16, ANSWER)  # no exception
        assert await down.get(b"k" * 16) is None
        assert down_stats.errors == 2 and down_stats.misses == 1

    asyncio.run(run())


@pytest.mark.parametrize("n", [1, 3])
def test_collector_counts_samples(n: int) -> None:
    collector = ResponseCollector(n)
    for i in range(n):
        collector.add(StreamDelta(i, (i,), str(i), "length", USAGE))
    result = collector.result()
    assert result is not None and [s.token_ids for s in result.samples] == [(i,) for i in range(n)]
