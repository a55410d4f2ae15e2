"""A peer as a source of the load planner, between two engines in one process (the link stages
and seals the holder's chunks directly, as its actor does): the puller computes only the rest of
the prompt and says the same greedy tokens; a corrupt, foreign-tenant or misplaced chunk is a
miss; a failing or late peer costs a recompute; the planner pulls only when the peer's cost
beats computing; the engine keeps stepping while a pull is in flight; the peer's cost is learned
from pulls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from cachesvc.kv.calibration import DEFAULT_TIER_COSTS
from cachesvc.kv.config import ConfigError, TierConfig
from cachesvc.kv.planner import TierCost
from workers.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.request import PeerSource
from workers.engine.tiering.peer import peer_tier
from workers.model.loader import LoadedModel, load_model
from workers.peer.stage import seal, stage_run, staging_buffer
from workers.sampling_params import SamplingParams
from workers.transfer.chunk import KVChunk, chunk_key

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = torch.randint(0, 320, (42,), generator=torch.Generator().manual_seed(3)).tolist()
NUM_FULL = len(PROMPT) // BS  # 10
HOLDER = PeerSource("holder", NUM_FULL)

Tamper = Callable[[KVChunk], KVChunk]
KEY = chunk_key(None)


def export(engine: Engine, prompt: Sequence[int], salt: str | None, lo: int, hi: int) -> KVChunk:
    """What the holder's actor sends for a chunk: staged, then sealed."""
    staged = stage_run(engine, prompt, salt, lo, hi, staging_buffer(engine, 1 << 30))
    return seal(staged, KEY, "fast", engine.loaded.fingerprint)


class LocalLink:
    """Serves pulls from engines of this process; `tamper` changes what is sent, `gate` holds
    every pull until it is set."""

    def __init__(self, peers: dict[str, Engine], tamper: Tamper | None = None) -> None:
        self.peers = peers
        self.tamper = tamper
        self.gate: threading.Event | None = None
        self.fail_from: int | None = None  # a call for this block or later fails (peer died)
        self.calls = 0

    def fetch(
        self,
        peer: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        chunks: Sequence[tuple[int, int]],
        deadline: float,
        follow: bool = False,
        stop: threading.Event | None = None,
    ) -> Iterator[KVChunk]:
        for start_block, end_block in chunks:
            self.calls += 1
            left = deadline - time.monotonic()
            if left <= 0 or (self.gate is not None and not self.gate.wait(left)):
                raise TimeoutError("peer did not answer")
            if self.fail_from is not None and start_block >= self.fail_from:
                raise ConnectionError("peer died")
            sent = export(self.peers[peer], token_ids, cache_salt, start_block, end_block)
            yield sent if self.tamper is None else self.tamper(sent)


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32, device="cpu")


def _engine(loaded: LoadedModel, **overrides: object) -> Engine:
    config = EngineConfig(model=str(loaded.path), block_size=BS, num_blocks=64)
    return Engine(replace(config, **overrides), loaded)  # type: ignore[arg-type]


def _puller(
    loaded: LoadedModel, holder: Engine, plan: str = "fetch", tamper: Tamper | None = None
) -> tuple[Engine, LocalLink]:
    puller = _engine(loaded, peer_pull=True, tiers=TierConfig(plan=plan, calibrate=False))
    link = LocalLink({HOLDER.name: holder}, tamper)
    puller.attach_peers(link)
    return puller, link


def _run(
    engine: Engine, prompt: list[int], salt: str | None = None, peer: PeerSource | None = None
) -> tuple[list[int], int, dict[str, int]]:
    [rid] = engine.add_request(prompt, GREEDY, cache_salt=salt, peer=peer)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                final = out
    assert final is not None
    return list(final.token_ids), final.num_cached_tokens, dict(final.cached_tokens_by_tier)


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[int]:
    tokens, _, _ = _run(_engine(loaded, enable_prefix_caching=False), PROMPT)
    return tokens


def _stats(engine: Engine) -> dict[str, float]:
    assert engine.tiering is not None and engine.tiering.peers is not None
    return engine.tiering.peers.stats.as_dict()


def _check_pool(engine: Engine) -> None:
    engine.pool.check_integrity()
    assert engine.pool.num_free == engine.pool.num_blocks  # nothing leaked


def test_pulled_blocks_give_the_same_tokens(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT, "t1")
    puller, link = _puller(loaded, holder)
    tokens, cached, by_tier = _run(puller, PROMPT, "t1", HOLDER)
    assert tokens == reference
    assert cached == NUM_FULL * BS and by_tier.get("peer") == NUM_FULL * BS
    assert link.calls == 1
    stats = _stats(puller)
    assert stats["peer_pulled_blocks"] == NUM_FULL and stats["peer_failures"] == 0
    assert stats["peer_measured_s"] > 0 and stats["peer_predicted_s"] > 0
    _check_pool(puller)
    # Landed blocks are cached like computed ones: the next request hits them on the device.
    _, cached, by_tier = _run(puller, PROMPT, "t1")
    assert cached == NUM_FULL * BS and by_tier.get("hbm") == NUM_FULL * BS


def test_pull_extends_own_prefix(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, _ = _puller(loaded, holder)
    _run(puller, PROMPT[:17])  # 4 full blocks of its own
    tokens, cached, by_tier = _run(puller, PROMPT, None, HOLDER)
    assert tokens == reference and cached == NUM_FULL * BS
    assert by_tier.get("hbm") == 4 * BS and by_tier.get("peer") == (NUM_FULL - 4) * BS
    assert _stats(puller)["peer_pulled_blocks"] == NUM_FULL - 4


def _damage(first_block: int) -> Tamper:
    """Flips one value of the chunk that starts at `first_block`."""

    def tamper(sent: KVChunk) -> KVChunk:
        if sent.start_block != first_block:
            return sent
        payload = sent.payload.copy()
        payload.reshape(-1)[7] += 1
        return KVChunk(sent.start_block, sent.dtype, payload, sent.digest)

    return tamper


def test_corrupt_chunk_is_a_miss(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, link = _puller(loaded, holder, tamper=_damage(4))
    assert puller.tiering is not None and puller.tiering.peers is not None
    puller.tiering.peers.chunk_blocks = 4  # blocks 0-3 arrive intact, 4-7 damaged
    tokens, cached, _ = _run(puller, PROMPT, None, HOLDER)
    assert tokens == reference and cached == 4 * BS
    assert _stats(puller)["peer_missed_blocks"] == NUM_FULL - 4
    _check_pool(puller)


def test_misplaced_blocks_are_a_miss(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)

    def shift(sent: KVChunk) -> KVChunk:  # block 0 sent as block 1 onwards
        rows = np.concatenate([sent.payload[:1], sent.payload[:-1]])
        return KVChunk(sent.start_block, sent.dtype, rows, sent.digest)

    def relabel(sent: KVChunk) -> KVChunk:  # the chunk of blocks 0.. offered as 1..
        return KVChunk(sent.start_block + 1, sent.dtype, sent.payload, sent.digest)

    for tamper in (shift, relabel):
        puller, _ = _puller(loaded, holder, tamper=tamper)
        tokens, cached, _ = _run(puller, PROMPT, None, HOLDER)
        assert tokens == reference and cached == 0
        _check_pool(puller)


def test_peer_never_serves_another_tenants_blocks(
    loaded: LoadedModel, reference: list[int]
) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT, "tenant:a")
    assert export(holder, PROMPT, "tenant:b", 0, NUM_FULL).num_blocks == 0
    assert export(holder, PROMPT, None, 0, NUM_FULL).num_blocks == 0
    puller, _ = _puller(loaded, holder)
    tokens, cached, _ = _run(puller, PROMPT, "tenant:b", HOLDER)
    assert tokens == reference and cached == 0
    # Tenant a's blocks handed to a request of tenant b do not verify.
    stolen = export(holder, PROMPT, "tenant:a", 0, NUM_FULL)
    thief, _ = _puller(loaded, holder, tamper=lambda _: stolen)
    tokens, cached, _ = _run(thief, PROMPT, "tenant:c", HOLDER)
    assert tokens == reference and cached == 0
    assert _stats(thief)["peer_missed_blocks"] == NUM_FULL


def test_blocks_from_the_peers_dram_tier(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded, num_blocks=12, tiers=TierConfig(dram_mb=16, calibrate=False))
    _run(holder, PROMPT)
    _run(holder, list(range(200, 240)))  # evicts the prompt's blocks: demoted to DRAM
    assert holder.tiering is not None and holder.tiering.manager.held_by_tier()["dram"]
    puller, _ = _puller(loaded, holder)
    tokens, cached, _ = _run(puller, PROMPT, None, HOLDER)
    assert tokens == reference and cached == NUM_FULL * BS


def test_failing_peer_costs_a_recompute(loaded: LoadedModel, reference: list[int]) -> None:
    puller, _ = _puller(loaded, _engine(loaded))
    tokens, cached, _ = _run(puller, PROMPT, None, PeerSource("gone", NUM_FULL))  # KeyError
    assert tokens == reference and cached == 0
    assert _stats(puller)["peer_failures"] == 1
    _check_pool(puller)


def test_planner_pulls_only_when_it_pays(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, link = _puller(loaded, holder, plan="auto")
    assert puller.tiering is not None
    costs = puller.tiering.costs
    costs.tiers[peer_tier(HOLDER.name)] = TierCost(10.0, 1e-9, 1e4)  # 10 s per pull
    tokens, cached, _ = _run(puller, PROMPT, None, HOLDER)
    assert tokens == reference and cached == 0 and link.calls == 0
    assert puller.tiering.last_plan is not None and puller.tiering.last_plan.kind == "recompute"
    puller.flush()
    costs.tiers[peer_tier(HOLDER.name)] = TierCost(0.0, 0.0, 1e4)  # free
    tokens, cached, _ = _run(puller, PROMPT, None, HOLDER)
    assert tokens == reference and cached == NUM_FULL * BS and link.calls == 1


def test_split_computes_the_front_while_the_back_arrives(
    loaded: LoadedModel, reference: list[int]
) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, _ = _puller(loaded, holder, plan="split")
    tokens, cached, by_tier = _run(puller, PROMPT, None, HOLDER)
    assert puller.tiering is not None and puller.tiering.last_plan is not None
    plan = puller.tiering.last_plan
    assert plan.kind == "split" and 0 < plan.split_block < NUM_FULL
    assert tokens == reference
    assert cached == by_tier["peer"] == (NUM_FULL - plan.split_block) * BS


def test_engine_keeps_stepping_while_a_pull_waits(
    loaded: LoadedModel, reference: list[int]
) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, link = _puller(loaded, holder)
    link.gate = threading.Event()
    [waiting] = puller.add_request(PROMPT, GREEDY, peer=HOLDER)
    other = list(range(100, 130))
    [busy] = puller.add_request(other, GREEDY)
    done: dict[str, list[int]] = {}
    for _ in range(50):
        for out in puller.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        if busy in done:
            break
    assert busy in done and waiting not in done  # the other request ran to its end meanwhile
    assert _stats(puller)["peer_in_flight_blocks"] == NUM_FULL  # in the load report
    # What the pull is to bring is not work the engine reports as queued.
    [request] = [r for r in puller.scheduler.running if r.request_id == waiting]
    assert puller.kv.num_free_tokens(request) == NUM_FULL * BS
    link.gate.set()
    while puller.has_unfinished():
        for out in puller.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    assert done[waiting] == reference
    assert _stats(puller)["peer_pulled_blocks"] == NUM_FULL
    assert _stats(puller)["peer_in_flight_blocks"] == 0
    _check_pool(puller)


def test_abort_while_a_pull_waits_leaks_nothing(loaded: LoadedModel) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, link = _puller(loaded, holder)
    link.gate = threading.Event()
    [rid] = puller.add_request(PROMPT, GREEDY, peer=HOLDER)
    puller.step()
    puller.abort(rid)
    link.gate.set()
    assert not puller.has_unfinished()
    _check_pool(puller)


def test_pulls_teach_the_peers_cost(loaded: LoadedModel) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, _ = _puller(loaded, holder)
    _run(puller, PROMPT, None, HOLDER)
    assert puller.tiering is not None
    learned = puller.tiering.costs.tiers[peer_tier(HOLDER.name)]
    prior = DEFAULT_TIER_COSTS["peer"][1]
    assert learned.seconds_per_byte != pytest.approx(prior)  # moved off the prior


def test_peer_pull_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="peer_pull_timeout_s"):
        EngineConfig(peer_pull=True, peer_pull_timeout_s=0.0)


def test_requests_of_one_prefix_share_one_pull(loaded: LoadedModel, reference: list[int]) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    other = PROMPT[:40] + [5, 6, 7]  # the same 10 full blocks, another tail
    expected_other, _, _ = _run(_engine(loaded, enable_prefix_caching=False), other)
    puller, link = _puller(loaded, holder)
    link.gate = threading.Event()
    [first] = puller.add_request(PROMPT, GREEDY, peer=HOLDER)
    [second] = puller.add_request(other, GREEDY, peer=HOLDER)
    puller.step()  # the first plans the pull; the second waits for it instead of its own
    # Neither reports the pulled run as work queued.
    for request in [*puller.scheduler.running, *puller.scheduler.waiting]:
        assert puller.kv.num_free_tokens(request) == NUM_FULL * BS
    link.gate.set()
    done = {}
    while puller.has_unfinished():
        for out in puller.step():
            if out.finished:
                done[out.request_id] = out
    assert link.calls == 1
    assert list(done[first].token_ids) == reference
    assert list(done[second].token_ids) == expected_other
    assert done[second].cached_tokens_by_tier.get("hbm") == NUM_FULL * BS  # the landed blocks
    _check_pool(puller)


def test_peer_dying_mid_pull_costs_only_what_did_not_arrive(
    loaded: LoadedModel, reference: list[int]
) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, link = _puller(loaded, holder)
    assert puller.tiering is not None and puller.tiering.peers is not None
    puller.tiering.peers.chunk_blocks = 4  # three calls: blocks 0-3, 4-7, 8-9
    link.fail_from = 8
    tokens, cached, by_tier = _run(puller, PROMPT, None, HOLDER)
    assert tokens == reference
    assert link.calls == 3 and cached == by_tier["peer"] == 8 * BS
    stats = _stats(puller)
    assert stats["peer_failures"] == 1 and stats["peer_missed_blocks"] == NUM_FULL - 8
    _check_pool(puller)


def test_a_pulls_deadline_runs_from_when_it_is_planned(
    loaded: LoadedModel, reference: list[int]
) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    puller, link = _puller(loaded, holder)
    peers = puller.tiering.peers if puller.tiering is not None else None
    assert peers is not None
    peers.timeout_s = 0.2
    peers._executor = ThreadPoolExecutor(max_workers=1)  # one pull thread, kept busy past it
    busy = peers._executor.submit(time.sleep, 0.6)
    tokens, cached, _ = _run(puller, PROMPT, None, HOLDER)
    busy.result()
    # The pull waited for the thread longer than its timeout: it is late, not fresh.
    assert tokens == reference and cached == 0
    assert _stats(puller)["peer_failures"] == 1
    _check_pool(puller)


def test_staging_gathers_what_read_block_reads_and_keeps_to_its_cap(loaded: LoadedModel) -> None:
    from workers.engine.kv_copy import read_block

    holder = _engine(loaded)
    _run(holder, PROMPT)
    full = stage_run(holder, PROMPT, None, 2, NUM_FULL, staging_buffer(holder, 1 << 30))
    assert full.start_block == 2 and full.payload.shape[0] == NUM_FULL - 2
    block_id = holder.pool.lookup(full.hashes[0], PROMPT[2 * BS : 3 * BS])
    assert block_id is not None
    assert np.array_equal(full.payload[0], read_block(holder.runner.kv_caches, block_id))
    one_block = full.payload[0].nbytes
    capped = stage_run(holder, PROMPT, None, 2, NUM_FULL, staging_buffer(holder, 3 * one_block))
    assert capped.payload.shape[0] == 3 and capped.hashes == full.hashes[:3]


def test_a_pinned_run_outlives_a_flush_until_unpinned(loaded: LoadedModel) -> None:
    """The exporter copies a run off the engine's loop while the engine steps on: pinned at a
    step boundary, its blocks are neither dropped nor handed out before the copy is done."""
    from workers.peer.stage import copy_run, pin_run, unpin

    holder = _engine(loaded)
    _run(holder, PROMPT)
    buffer = staging_buffer(holder, 1 << 30)
    expected = stage_run(holder, PROMPT, None, 0, NUM_FULL, buffer).payload.copy()
    run = pin_run(holder, PROMPT, None, 0, NUM_FULL, NUM_FULL)
    assert len(run.device) == NUM_FULL
    holder.flush()  # drops every cached block nobody holds
    taken = holder.pool.allocate(holder.pool.num_free)  # and new KV takes every free one
    assert not set(taken) & set(run.device)
    for i, h in enumerate(run.hashes):
        assert holder.pool.lookup(h, PROMPT[i * BS : (i + 1) * BS]) == run.device[i]
    staged = copy_run(holder.runner.kv_caches, run, buffer)
    np.testing.assert_array_equal(staged.payload, expected)
    holder.pool.free(taken)
    unpin(holder, run)
    _check_pool(holder)


def test_a_strict_digest_covers_the_payload(loaded: LoadedModel) -> None:
    from workers.transfer.chunk import verify_chunk

    holder = _engine(loaded)
    _run(holder, PROMPT)
    fp = holder.loaded.fingerprint
    staged = stage_run(holder, PROMPT, None, 0, NUM_FULL, staging_buffer(holder, 1 << 30))
    shape = staged.payload.shape[1:]
    for mode in ("fast", "strict"):
        chunk = seal(staged, KEY, mode, fp)
        assert verify_chunk(chunk, KEY, mode, fp, staged.hashes, shape)
        other = "strict" if mode == "fast" else "fast"
        assert not verify_chunk(chunk, KEY, other, fp, staged.hashes, shape)
        assert not verify_chunk(chunk, chunk_key(b"k" * 32), mode, fp, staged.hashes, shape)
        damaged = staged.payload.copy()
        damaged.reshape(-1)[-1] += 1
        forged = KVChunk(0, chunk.dtype, damaged, chunk.digest)
        assert not verify_chunk(forged, KEY, mode, fp, staged.hashes, shape)


def test_lossy_kv_travels_marked_and_lands_marked(loaded: LoadedModel) -> None:
    holder = _engine(loaded)
    _run(holder, PROMPT)
    staged = stage_run(holder, PROMPT, None, 0, NUM_FULL, staging_buffer(holder, 1 << 30))
    assert not staged.lossy
    ids = [
        holder.pool.lookup(h, PROMPT[i * BS : (i + 1) * BS]) for i, h in enumerate(staged.hashes)
    ]
    holder.pool.mark_lossy([i for i in ids if i is not None][3:4])  # as if landed from int8
    assert export(holder, PROMPT, None, 0, NUM_FULL).lossy
    flipped = KVChunk(
        0, "float32", staged.payload, export(holder, PROMPT, None, 0, NUM_FULL).digest
    )
    puller, _ = _puller(loaded, holder, tamper=lambda _: flipped)  # the mark stripped in transit
    _, cached, _ = _run(puller, PROMPT, None, HOLDER)
    assert cached == 0
    puller, _ = _puller(loaded, holder)
    _, cached, _ = _run(puller, PROMPT, None, HOLDER)
    assert cached == NUM_FULL * BS
    landed = [
        puller.pool.lookup(h, PROMPT[i * BS : (i + 1) * BS]) for i, h in enumerate(staged.hashes)
    ]
    assert all(i is not None and puller.pool.is_lossy(i) for i in landed)
