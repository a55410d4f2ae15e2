"""Blocks pulled from a peer engine: the puller computes only the rest of the prompt and says the
same greedy tokens; a corrupt, foreign-tenant or misplaced block is a miss; a peer never serves
a block under another tenant's salt; blocks come from the peer's device pool or its DRAM tier."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cachesvc.config import ConfigError, EngineConfig, TierConfig
from workers.engine.engine import Engine
from workers.engine.peer import PeerBlocks, export_blocks, import_blocks, num_device_blocks
from workers.model.loader import LoadedModel, load_model
from workers.sampling_params import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = torch.randint(0, 320, (42,), generator=torch.Generator().manual_seed(3)).tolist()
NUM_FULL = len(PROMPT) // BS  # 10


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir), dtype=torch.float32, device="cpu")


def _engine(loaded: LoadedModel, **overrides: object) -> Engine:
    config = EngineConfig(model=str(loaded.path), block_size=BS, num_blocks=64)
    return Engine(replace(config, **overrides), loaded)  # type: ignore[arg-type]


def _run(engine: Engine, prompt: list[int], salt: str | None = None) -> tuple[list[int], int]:
    [out] = engine.generate([prompt], GREEDY, cache_salt=salt)
    return list(out.token_ids), out.num_cached_tokens


def _reference(loaded: LoadedModel) -> list[int]:
    tokens, _ = _run(_engine(loaded, enable_prefix_caching=False), PROMPT)
    return tokens


def test_pulled_blocks_give_the_same_tokens(loaded: LoadedModel) -> None:
    holder, puller = _engine(loaded), _engine(loaded)
    _run(holder, PROMPT, "t1")
    sent = export_blocks(holder, PROMPT, "t1", 0, NUM_FULL)
    assert len(sent.blobs) == NUM_FULL
    assert import_blocks(puller, PROMPT, "t1", sent) == NUM_FULL
    assert num_device_blocks(puller, PROMPT, "t1") == NUM_FULL
    tokens, cached = _run(puller, PROMPT, "t1")
    assert tokens == _reference(loaded)
    assert cached == NUM_FULL * BS
    puller.pool.check_integrity()
    assert puller.pool.num_free == puller.pool.num_blocks


def test_partial_pull_extends_own_prefix(loaded: LoadedModel) -> None:
    holder, puller = _engine(loaded), _engine(loaded)
    _run(holder, PROMPT)
    _run(puller, PROMPT[:17])  # 4 full blocks of its own
    have = num_device_blocks(puller, PROMPT, None)
    assert have == 4
    sent = export_blocks(holder, PROMPT, None, have, NUM_FULL)
    assert sent.start_block == 4 and len(sent.blobs) == NUM_FULL - 4
    assert import_blocks(puller, PROMPT, None, sent) == NUM_FULL - 4
    tokens, cached = _run(puller, PROMPT)
    assert tokens == _reference(loaded) and cached == NUM_FULL * BS


def test_corrupt_block_is_a_miss(loaded: LoadedModel) -> None:
    holder, puller = _engine(loaded), _engine(loaded)
    _run(holder, PROMPT)
    blobs = list(export_blocks(holder, PROMPT, None, 0, NUM_FULL).blobs)
    damaged = bytearray(blobs[3])
    damaged[-5] ^= 0xFF
    blobs[3] = bytes(damaged)
    assert import_blocks(puller, PROMPT, None, PeerBlocks(0, tuple(blobs))) == 3
    tokens, cached = _run(puller, PROMPT)
    assert tokens == _reference(loaded) and cached == 3 * BS


def test_misplaced_blocks_are_a_miss(loaded: LoadedModel) -> None:
    holder, puller = _engine(loaded), _engine(loaded)
    _run(holder, PROMPT)
    sent = export_blocks(holder, PROMPT, None, 0, NUM_FULL)
    assert import_blocks(puller, PROMPT, None, PeerBlocks(1, sent.blobs)) == 0
    assert puller.pool.num_cached == 0


def test_peer_never_serves_another_tenants_blocks(loaded: LoadedModel) -> None:
    holder, puller = _engine(loaded), _engine(loaded)
    _run(holder, PROMPT, "tenant:a")
    assert export_blocks(holder, PROMPT, "tenant:b", 0, NUM_FULL).blobs == ()
    assert export_blocks(holder, PROMPT, None, 0, NUM_FULL).blobs == ()
    # Tenant a's blocks handed to a request of tenant b do not verify.
    sent = export_blocks(holder, PROMPT, "tenant:a", 0, NUM_FULL)
    assert import_blocks(puller, PROMPT, "tenant:b", sent) == 0
    assert puller.pool.num_cached == 0


def test_blocks_from_the_peers_dram_tier(loaded: LoadedModel) -> None:
    holder = _engine(loaded, num_blocks=12, tiers=TierConfig(dram_mb=16, calibrate=False))
    puller = _engine(loaded)
    _run(holder, PROMPT)
    _run(holder, list(range(200, 240)))  # evicts the prompt's blocks: demoted to DRAM
    assert holder.tiering is not None
    assert num_device_blocks(holder, PROMPT, None) == 0
    assert holder.tiering.manager.held_by_tier()["dram"]
    sent = export_blocks(holder, PROMPT, None, 0, NUM_FULL)
    assert len(sent.blobs) == NUM_FULL
    assert import_blocks(puller, PROMPT, None, sent) == NUM_FULL
    tokens, cached = _run(puller, PROMPT)
    assert tokens == _reference(loaded) and cached == NUM_FULL * BS


def test_pull_keeps_a_block_free(loaded: LoadedModel) -> None:
    holder, puller = _engine(loaded), _engine(loaded, num_blocks=6)
    _run(holder, PROMPT)
    sent = export_blocks(holder, PROMPT, None, 0, NUM_FULL)
    assert import_blocks(puller, PROMPT, None, sent) == 5
    puller.pool.check_integrity()


@pytest.mark.parametrize("field", [{"peer_pull_min_blocks": 0}, {"peer_pull_timeout_s": 0.0}])
def test_peer_pull_config_is_validated(field: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="peer_pull"):
        EngineConfig(peer_pull=True, **field)  # type: ignore[arg-type]
