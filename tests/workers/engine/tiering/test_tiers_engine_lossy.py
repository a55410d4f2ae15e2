"""Lossy KV through the engine: a prefix read back from an int8 tier lands marked lossy in the
device pool, and so is the KV computed over it; evicted, none of it goes to a lossless DRAM,
NVMe or Redis tier (only to the quantized one), not even at a graceful stop; the answer says it
came from lossy KV (`RequestOutput.lossy_kv`, every sample of it), and one computed from exact KV
does not; the marks go with the blocks' hashes and a prefix computed afresh is exact again; a
peer pulling a prefix its holder keeps in an int8 tier receives it marked, and lands it so."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
import redis
from test_tiers_engine import (
    BS,
    GREEDY,
    A,
    B,
    C,
    _chain,
    check,
    make_engine,
    no_cache_tokens,
    run,
)

from cachesvc.kv.config import TierConfig
from cachesvc.kv.tiers.tier_manager import TierManager
from cachesvc.kv.types import BlockId
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import PeerSource
from workers.peer.stage import seal, stage_run, staging_buffer
from workers.sampling_params import SamplingParams
from workers.transfer.chunk import KVChunk, chunk_key


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> Callable[[list[int]], list[int]]:
    return no_cache_tokens(tiny_llama_dir)


def _tiers(tmp_path: Path, **kw: object) -> TierConfig:
    """Lossless DRAM, then an int8 NVMe tier (what a lossy block may go to)."""
    nvme = str(tmp_path / "nvme")
    return TierConfig(  # type: ignore[arg-type]
        dram_mb=1, nvme_path=nvme, nvme_mb=4, nvme_codec="int8", plan="fetch", **kw
    )


def _manager(engine: Engine) -> TierManager:
    assert engine.tiering is not None
    return engine.tiering.manager


def _lossy_blocks(engine: Engine) -> int:
    """Cached device blocks (a hash registered) marked lossy: the ones a request could match."""
    pool = engine.pool
    ids = [BlockId(i) for i in range(pool.num_blocks)]
    return sum(pool.is_lossy(i) for i in ids if pool.block_hash(i) is not None)


def _prefix_in_int8_nvme(engine: Engine) -> None:
    """A computed, demoted into DRAM (exact), then moved down into the int8 NVMe tier."""
    assert run(engine, A)[1].get("nvme", 0) == 0
    engine.pool.reset_cache()
    _manager(engine).spill()
    assert _manager(engine).tier("dram").entries() == {}
    assert len(_manager(engine).tier("nvme").entries()) >= 12


def test_a_prefix_from_an_int8_tier_is_marked_and_never_demoted_losslessly(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama_dir, _tiers(tmp_path))
    _prefix_in_int8_nvme(engine)
    [out] = engine.generate([B], GREEDY)
    assert out.lossy_kv and engine.tiering is not None
    assert engine.tiering.usage(out.request_id)["nvme"] == 12 * BS
    # Landed from int8: the 12 prefix blocks; computed over them: B's 13th block.
    chain = _chain(engine, B)
    marked = []
    for i, h in enumerate(chain):
        block_id = engine.pool.lookup(h, B[i * BS : (i + 1) * BS])
        assert block_id is not None
        marked.append(engine.pool.is_lossy(block_id))
    assert marked == [True] * 13
    assert _manager(engine).stats.lossy_refused == 0
    engine.pool.reset_cache()  # every block leaves the device: lossy, so not into raw DRAM
    assert _manager(engine).tier("dram").entries() == {}
    assert chain[12] in _manager(engine).tier("nvme").entries()  # int8: kept there
    # B's 13th block and the one its output filled went to DRAM first: refused there.
    assert _manager(engine).stats.lossy_refused == 2
    assert _lossy_blocks(engine) == 0  # the marks went with the hashes
    check(engine)
    engine.close()


def test_a_lossy_prefix_is_not_spilled_into_a_lossless_nvme_tier_at_a_graceful_stop(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """int8 DRAM above raw NVMe: whatever DRAM holds is lossy, so at close nothing of it goes
    down to NVMe, where a restarted worker (and its peers) would read it as exact KV. The
    request's own exact blocks on the device were quantized in DRAM only."""
    folder = tmp_path / "nvme"
    # A pinned plan: with the calibrated one a loaded machine may recompute B's prefix instead
    # of reading it back from DRAM, and then nothing lossy is on the device.
    tiers = TierConfig(dram_mb=1, dram_codec="int8", nvme_path=str(folder), nvme_mb=4, plan="fetch")
    engine = make_engine(tiny_llama_dir, tiers)
    run(engine, A)
    engine.pool.reset_cache()
    [out] = engine.generate([B], GREEDY)
    assert out.lossy_kv
    engine.close()  # demotes the device, then spills DRAM into NVMe
    assert list(folder.iterdir()) == []
    assert _manager(engine).stats.lossy_refused > 0


def test_every_answer_over_lossy_kv_says_so_and_none_over_exact_kv(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    engine = make_engine(tiny_llama_dir, _tiers(tmp_path), num_blocks=48)
    [exact] = engine.generate([A], GREEDY)  # computed
    [again] = engine.generate([A], GREEDY)  # from the device: exact KV
    assert not exact.lossy_kv and not again.lossy_kv
    engine.pool.reset_cache()
    _manager(engine).spill()
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=1, n=2, ignore_eos=True)
    samples = engine.generate([C], params)  # the second sample forks from the first
    assert len(samples) == 2 and all(o.lossy_kv for o in samples)
    [matched] = engine.generate([C[:-1] + [7]], GREEDY)  # the lossy blocks on the device
    assert matched.lossy_kv
    assert engine.tiering is not None and engine.tiering.usage(matched.request_id)["hbm"] > 0
    [other] = engine.generate([list(range(30, 60))], GREEDY)  # shares nothing: exact
    assert not other.lossy_kv
    engine.close()


def test_a_prefix_computed_afresh_is_exact_again(
    tiny_llama_dir: Path, tmp_path: Path, expected: Callable[[list[int]], list[int]]
) -> None:
    engine = make_engine(tiny_llama_dir, _tiers(tmp_path))
    _prefix_in_int8_nvme(engine)
    [lossy] = engine.generate([B], GREEDY)
    assert lossy.lossy_kv and _lossy_blocks(engine) > 0
    engine.purge()  # every tier and the device's cached blocks: the prefix is gone
    assert _lossy_blocks(engine) == 0
    [fresh] = engine.generate([B], GREEDY)
    assert not fresh.lossy_kv and _lossy_blocks(engine) == 0
    assert list(fresh.token_ids) == expected(B)
    engine.pool.reset_cache()  # exact again: raw DRAM takes it
    assert set(_chain(engine, B)) <= set(_manager(engine).tier("dram").entries())
    check(engine)
    engine.close()


def test_lossy_kv_is_not_shared_to_a_lossless_redis(
    tiny_llama_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    engine = make_engine(tiny_llama_dir, _tiers(tmp_path, redis_url=redis_url, redis_min_reuse=0))
    _prefix_in_int8_nvme(engine)  # A's exact blocks were shared on the way down
    shared = _manager(engine).tier("redis")
    shared.flush()  # type: ignore[attr-defined]
    [out] = engine.generate([B], GREEDY)
    assert out.lossy_kv
    engine.pool.reset_cache()  # B's 13th block, computed over lossy KV, leaves the device
    shared.flush()  # type: ignore[attr-defined]
    chain = _chain(engine, B)
    assert shared.contains_prefix(chain) == 12  # A's exact prefix, not B's lossy block
    assert _manager(engine).stats.lossy_refused > 0
    engine.close()


class _Holder:
    """A peer link to one engine of this process, staging and sealing as its actor does."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def fetch(
        self,
        peer: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        chunks: Sequence[tuple[int, int]],
        deadline: float,
    ) -> Iterator[KVChunk]:
        for lo, hi in chunks:
            assert time.monotonic() < deadline
            buffer = staging_buffer(self.engine, 1 << 30)
            staged = stage_run(self.engine, token_ids, cache_salt, lo, hi, buffer)
            yield seal(staged, chunk_key(None), "fast", self.engine.loaded.fingerprint)


def test_a_peer_pulls_a_lossy_prefix_marked_and_answers_lossy(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    holder = make_engine(tiny_llama_dir, _tiers(tmp_path))
    _prefix_in_int8_nvme(holder)  # held in the int8 tier only, none of it on the device
    config = EngineConfig(
        model=str(tiny_llama_dir),
        block_size=BS,
        num_blocks=24,
        peer_pull=True,
        tiers=TierConfig(plan="fetch", calibrate=False),
    )
    puller = Engine(config, holder.loaded)
    puller.attach_peers(_Holder(holder))
    puller.add_request(B, GREEDY, peer=PeerSource("holder", 12))
    outs = []
    while puller.has_unfinished():
        outs.extend(o for o in puller.step() if o.finished)
    [out] = outs
    assert out.cached_tokens_by_tier == {"peer": 12 * BS}
    assert out.lossy_kv  # the pulled KV was dequantized on the holder
    for i, h in enumerate(_chain(puller, B)[:12]):
        block_id = puller.pool.lookup(h, B[i * BS : (i + 1) * BS])
        assert block_id is not None and puller.pool.is_lossy(block_id)
    puller.close()
    holder.close()
