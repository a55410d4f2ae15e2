"""The response cache's parts: keys, the signed entry format, the collector, the memory LRU and
the write queue. The Redis store has its own file (test_response_store.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from router.auth import tenant_cache_salt
from router.response_cache.cache import (
    CachedResponse,
    CachedSample,
    EntryShape,
    ResponseCache,
    ResponseCollector,
    StoreStats,
    is_deterministic,
    num_samples,
    response_key,
)
from router.response_cache.entry import EntryCodec
from router.response_cache.store import MemoryResponseStore
from workers.protocol import StreamDelta, Usage
from workers.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
USAGE = Usage(3, 2, {"hbm": 2}, 1, 5.0, 100.0, "worker-0")
ANSWER = CachedResponse((CachedSample((5, 6), "hi", "length", USAGE),))
SHAPE = EntryShape(num_samples=1, vocab_size=100)
SECRET = b"s" * 32
KEY, OTHER_KEY = b"a" * 16, b"b" * 16


def _cache(store_bytes: int = 2**20, **options: Any) -> tuple[ResponseCache, StoreStats]:
    stats = StoreStats()
    store = MemoryResponseStore(store_bytes, stats)
    return ResponseCache(store, EntryCodec(SECRET), stats, **options), stats


def test_only_deterministic_requests_are_cacheable() -> None:
    assert is_deterministic(GREEDY)
    assert is_deterministic(SamplingParams(temperature=0.9, seed=7))
    assert is_deterministic(SamplingParams(temperature=0.9, beam_width=2))
    assert not is_deterministic(SamplingParams(temperature=0.9))
    assert num_samples(SamplingParams(n=3, seed=1)) == 3
    assert num_samples(SamplingParams(beam_width=4)) == 1


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


def test_the_whole_salt_keys_the_entry_however_long() -> None:
    # Valid tenant names of the longest length (64), equal but for the last character: their
    # salts ("tenant:" + name) are longer than a BLAKE2b key, so a key cut to 64 bytes met.
    stem = "acme-corporation-production-eu-west-1-inference-cluster-team-"
    team_a, team_b = stem + "a" * 3, stem + "b" * 3
    assert len(team_a) == len(team_b) == 64
    salt_a, salt_b = tenant_cache_salt(team_a, None), tenant_cache_salt(team_b, None)
    assert response_key("fp", salt_a, [1, 2], GREEDY) != response_key("fp", salt_b, [1, 2], GREEDY)
    # Request salts of 256 bytes that differ only in their last byte, with or without a tenant.
    long_a, long_b = "x" * 255 + "a", "x" * 255 + "b"
    assert response_key("fp", long_a, [1], GREEDY) != response_key("fp", long_b, [1], GREEDY)
    with_tenant = [tenant_cache_salt("t", salt) for salt in (long_a, long_b)]
    keys = {response_key("fp", salt, [1], GREEDY) for salt in with_tenant}
    assert len(keys) == 2
    # None and "" are one salt, as for the KV blocks the workers hash.
    assert response_key("fp", None, [1], GREEDY) == response_key("fp", "", [1], GREEDY)


def test_entries_round_trip_and_damage_is_a_miss() -> None:
    codec = EntryCodec(SECRET)
    blob = codec.encode(KEY, ANSWER)
    assert codec.decode(KEY, blob, SHAPE) == ANSWER
    flipped = bytearray(blob)
    flipped[-3] ^= 1
    assert codec.decode(KEY, bytes(flipped), SHAPE) is None
    assert codec.decode(KEY, blob[:10], SHAPE) is None
    assert codec.decode(KEY, b"XXXX" + blob[4:], SHAPE) is None


def test_a_forged_or_swapped_entry_is_refused() -> None:
    codec = EntryCodec(SECRET)
    forged = EntryCodec(b"f" * 32).encode(KEY, ANSWER)  # well formed, signed with another key
    assert codec.decode(KEY, forged, SHAPE) is None
    # Key A's genuine entry, stored under key B's name (another prompt, or another tenant).
    assert codec.decode(OTHER_KEY, codec.encode(KEY, ANSWER), SHAPE) is None


def _sample(**changes: Any) -> CachedSample:
    return dataclasses.replace(ANSWER.samples[0], **changes)


@pytest.mark.parametrize(
    "response",
    [
        CachedResponse((_sample(), _sample())),  # two samples for a request of one
        CachedResponse(()),
        CachedResponse((_sample(token_ids=(5, 100)),)),  # outside a vocabulary of 100
        CachedResponse((_sample(token_ids=(-1,)),)),
        CachedResponse((_sample(token_ids=(True,)),)),
        CachedResponse((_sample(text=7),)),
        CachedResponse((_sample(finish_reason="abort"),)),
        CachedResponse((_sample(usage=dataclasses.replace(USAGE, prompt_tokens="3")),)),
        CachedResponse((_sample(usage=dataclasses.replace(USAGE, cached_tokens={"hbm": 1.5})),)),
        CachedResponse((_sample(usage=dataclasses.replace(USAGE, worker_id=None)),)),
    ],
)
def test_a_signed_entry_that_does_not_fit_the_request_is_refused(response: Any) -> None:
    # Signed with the right key, so only the validation can catch it (an older router's bug,
    # or a writer that holds the key but not the model).
    codec = EntryCodec(SECRET)
    assert codec.decode(KEY, codec.encode(KEY, response), SHAPE) is None


def test_refused_entries_are_counted_misses() -> None:
    cache, stats = _cache()

    async def run() -> None:
        await cache.store.put(KEY, EntryCodec(b"f" * 32).encode(KEY, ANSWER))  # forged
        await cache.store.put(OTHER_KEY, cache.codec.encode(KEY, ANSWER))  # swapped
        assert await cache.get(KEY, SHAPE) is None
        assert await cache.get(OTHER_KEY, SHAPE) is None
        assert await cache.get(b"c" * 16, SHAPE) is None  # absent: a miss, not a rejection

    asyncio.run(run())
    assert (stats.rejected, stats.misses, stats.hits) == (2, 3, 0)


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


def test_an_answer_from_lossy_kv_is_never_stored() -> None:
    lossy = dataclasses.replace(USAGE, lossy_kv=True)
    collector = ResponseCollector(2)
    collector.add(StreamDelta(0, (1,), "a", "length", USAGE))
    collector.add(StreamDelta(1, (2,), "b", "length", lossy))  # one sample is enough
    assert collector.result() is None


@pytest.mark.parametrize("n", [1, 3])
def test_collector_counts_samples(n: int) -> None:
    collector = ResponseCollector(n)
    for i in range(n):
        collector.add(StreamDelta(i, (i,), str(i), "length", USAGE))
    result = collector.result()
    assert result is not None and [s.token_ids for s in result.samples] == [(i,) for i in range(n)]


def test_the_memory_store_is_an_lru_bounded_in_bytes() -> None:
    blob = EntryCodec(SECRET).encode(KEY, ANSWER)
    cache, stats = _cache(store_bytes=2 * (16 + len(blob)))

    async def run() -> None:
        keys = [bytes([i]) * 16 for i in range(3)]
        assert await cache.put(keys[0], ANSWER)
        assert await cache.put(keys[1], ANSWER)
        assert await cache.get(keys[0], SHAPE) == ANSWER  # now the most recent
        assert await cache.put(keys[2], ANSWER)  # evicts keys[1]
        assert await cache.get(keys[1], SHAPE) is None
        assert await cache.get(keys[2], SHAPE) == ANSWER
        assert stats.evictions == 1 and stats.entries == 2
        assert stats.bytes <= 2 * (16 + len(blob))
        assert await cache.clear() == 2 and stats.bytes == 0

    asyncio.run(run())
    assert stats.hits == 2 and stats.misses == 1


def test_offered_answers_are_written_after_the_call_and_overflow_is_dropped() -> None:
    cache, stats = _cache(queue_entries=2)
    keys = [bytes([i]) * 16 for i in range(5)]

    async def run() -> None:
        for key in keys:  # no await between offers: the writer has not run yet
            cache.offer(key, ANSWER)
        assert stats.dropped == 3 and stats.stores == 0
        await cache.flush()
        assert stats.stores == 2
        assert [await cache.get(k, SHAPE) == ANSWER for k in keys] == [True] * 2 + [False] * 3
        cache.offer(keys[4], ANSWER)  # room again once written
        await cache.flush()
        assert await cache.get(keys[4], SHAPE) == ANSWER

    asyncio.run(run())


def test_an_answer_over_the_entry_limit_is_not_stored() -> None:
    cache, stats = _cache(max_entry_bytes=1024)
    long_text = CachedResponse((_sample(text="x" * 2000),))  # refused before encoding
    just_over = CachedResponse((_sample(text="x" * 900),))  # refused once encoded (usage etc.)

    async def run() -> None:
        cache.offer(KEY, long_text)
        cache.offer(OTHER_KEY, just_over)
        await cache.flush()
        assert await cache.get(KEY, SHAPE) is None
        assert await cache.get(OTHER_KEY, SHAPE) is None
        cache.offer(KEY, ANSWER)
        await cache.flush()
        assert await cache.get(KEY, SHAPE) == ANSWER

    asyncio.run(run())
    assert stats.too_large == 2 and stats.stores == 1


def test_clear_drops_queued_answers_too() -> None:
    cache, stats = _cache()

    async def run() -> None:
        cache.offer(KEY, ANSWER)
        await cache.clear()
        assert await cache.get(KEY, SHAPE) is None
        await cache.close()

    asyncio.run(run())
    assert stats.stores == 0
