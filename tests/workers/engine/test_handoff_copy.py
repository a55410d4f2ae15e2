"""A hand-off's decode worker holds a copy of a prompt its prefill worker keeps: when the
request ends, the copy's blocks are the first the pool evicts, so it does not crowd out this
worker's own cached prefixes."""

from __future__ import annotations

from cachesvc.kv.block_pool import BlockPool
from workers.engine.kv_manager import KVCacheManager
from workers.engine.request import PeerSource, Request
from workers.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _served(kv: KVCacheManager, name: str, seed: int, peer: PeerSource | None) -> Request:
    """A 2-block prompt computed and released, as the engine does at its end."""
    prompt = [(seed * 13 + j) % 97 + 3 for j in range(2 * BS)]
    request = Request(name, prompt, PARAMS, peer=peer)
    assert kv.allocate_slots(request, len(prompt))
    request.num_computed_tokens = len(prompt)
    kv.free(request)
    return request


def _cached(kv: KVCacheManager, seed: int) -> int:
    prompt = [(seed * 13 + j) % 97 + 3 for j in range(2 * BS)] + [1]
    probe = Request("probe", prompt, PARAMS)
    match = kv.match_prefix(probe)
    kv.free(probe)
    return match.num_cached_tokens // BS


def test_a_handoff_copy_is_evicted_before_the_workers_own_prefixes() -> None:
    kv = KVCacheManager(BlockPool(6), BS)
    _served(kv, "own", 1, None)
    _served(kv, "copy", 2, PeerSource("prefill-0", 2, handoff=True))
    _served(kv, "pulled", 3, PeerSource("holder-0", 2))  # a plain pull: cached as usual
    assert kv.pool.num_free == 6
    kv.pool.allocate(2)  # room for something new: the copy goes, nothing of the others
    assert [_cached(kv, s) for s in (1, 2, 3)] == [2, 0, 2]
    kv.pool.check_integrity()
