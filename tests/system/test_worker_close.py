"""`WorkerActor.close` writes the device pool's cached blocks down to the NVMe tier and flushes it:
right after it returns and the actor is killed, a new worker over the same folder finds every
block the first one held."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from cachesvc.kv.config import TierConfig
from cachesvc.kv.events import BlockStored, Event
from cachesvc.kv.types import BlockHash
from workers.config import EngineConfig

pytestmark = pytest.mark.system


def _nvme_blocks(events: tuple[Event, ...]) -> set[BlockHash]:
    return {
        h for e in events if isinstance(e, BlockStored) and e.tier == "nvme" for h in e.block_hashes
    }


def test_close_flushes_the_nvme_tier(
    ray_cluster: None, engine_config: EngineConfig, tmp_path: Path
) -> None:
    import ray

    from workers.spawn import spawn_worker

    tiers = TierConfig(nvme_path=str(tmp_path), nvme_mb=16, calibrate=False)
    config = dataclasses.replace(engine_config, tiers=tiers)
    first = spawn_worker("worker-0", config, num_cpus=0.5, max_restarts=0)
    params = {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    for i in range(4):
        prompt = [10 + 11 * i + j for j in range(40)]  # ten blocks each
        stream = first.generate.options(num_returns="streaming").remote(
            prompt, params, f"r{i}", None
        )
        for ref in stream:
            ray.get(ref)
    held = set(ray.get(first.snapshot.remote()).blocks["hbm"])
    assert len(held) >= 40  # ten blocks of each prompt, all on the device
    assert ray.get(first.close.remote(), timeout=60)
    ray.kill(first)  # at once: only what close flushed is on disk
    assert not list(tmp_path.glob(".*tmp*")), "no write was left half done"

    second = spawn_worker("worker-0", config, num_cpus=0.5, max_restarts=0)
    try:
        assert _nvme_blocks(ray.get(second.poll.remote(0)).events) == held
    finally:
        ray.kill(second)
