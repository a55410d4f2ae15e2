"""The engine over quantized tiers (opt-in): a prefix demoted into an int8 or fp8 DRAM tier is
fetched back as cached tokens, and what lands on the device is exactly the codec's round trip
of the KV that left it; the tier holds more blocks per MiB and the planner sees its smaller
blocks; a damaged quantized block (bad checksum, or bad MAC with a tier key) is a miss, computed
instead; and the same engine with raw tiers gives exactly the no-cache tokens."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_tiers_engine import BS, GREEDY, A, B, _chain, check, make_engine, no_cache_tokens, run

from cachesvc.kv.codec import Codec
from cachesvc.kv.config import TierConfig
from cachesvc.kv.types import BlockHash, BlockId
from workers.engine.engine import Engine
from workers.engine.kv_copy import read_block

QUANTIZED = ("int8", "fp8_e4m3")


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> Callable[[list[int]], list[int]]:
    return no_cache_tokens(tiny_llama_dir)


def _device_kv(engine: Engine) -> dict[BlockHash, np.ndarray]:
    """The KV of every cached device block, by hash."""
    caches = engine.runner.kv_caches
    out = {}
    for i in range(engine.pool.num_blocks):
        block_hash = engine.pool.block_hash(BlockId(i))
        if block_hash is not None:
            out[block_hash] = read_block(caches, BlockId(i))
    return out


def _round_trip(codec: Codec, block_hash: BlockHash, array: np.ndarray) -> np.ndarray:
    block = codec.decode(codec.encode(block_hash, None, "float32", array), block_hash)
    assert block is not None
    return block.array


@pytest.mark.parametrize("mode", QUANTIZED)
def test_a_quantized_dram_tier_serves_the_prefix_it_quantized(
    tiny_llama_dir: Path, mode: str
) -> None:
    engine = make_engine(tiny_llama_dir, TierConfig(dram_mb=1, dram_codec=mode, plan="fetch"))
    run(engine, A)
    left = _device_kv(engine)  # the KV each block leaves the device with
    engine.pool.reset_cache()
    tokens, usage = run(engine, B)
    assert usage["dram"] == 12 * BS and len(tokens) == 6  # the whole shared prefix was cached
    landed = _device_kv(engine)
    codec = Codec(engine.loaded.fingerprint, mode)
    for block_hash in _chain(engine, A)[:12]:
        want = _round_trip(codec, block_hash, left[block_hash])
        assert landed[block_hash].tobytes() == want.tobytes()  # dequantized, nothing else
        assert not np.array_equal(want, left[block_hash])  # and not the raw KV
    check(engine)
    engine.close()


def test_a_quantized_tier_holds_more_blocks_and_the_planner_knows_their_size(
    tiny_llama_dir: Path,
) -> None:
    sizes = {}
    for mode in ("raw", "int8"):
        engine = make_engine(tiny_llama_dir, TierConfig(dram_mb=1, dram_codec=mode))
        assert engine.tiering is not None
        dram = engine.tiering.manager.tier("dram")
        codec = engine.tiering.manager.codecs["dram"]
        blob = codec.max_blob_size(engine.tiering.dtype, engine.tiering.block_shape)
        assert engine.tiering.costs.tiers["dram"].bytes_per_block == blob  # probed at start
        sizes[mode] = (dram.num_slots, blob)  # type: ignore[attr-defined]
        engine.close()
    # 4 tokens per block here: K's per-channel scales cost more than at 16 (3.7x smaller).
    assert sizes["int8"][0] > 2 * sizes["raw"][0] and sizes["int8"][1] * 2 < sizes["raw"][1]


@pytest.mark.parametrize("mode", QUANTIZED)
def test_real_kv_round_trips_within_half_a_step(tiny_llama_dir: Path, mode: str) -> None:
    """On the tiny model's own KV: every value within half a code step of its channel (K) or
    token (V) range, and a small error overall."""
    engine = make_engine(tiny_llama_dir, TierConfig())
    engine.generate([A + B[-5:]], GREEDY)
    codec = Codec(engine.loaded.fingerprint, mode)
    kv = np.stack(list(_device_kv(engine).values()))
    got = np.stack([_round_trip(codec, BlockHash(bytes(16)), block) for block in kv])
    k_range = np.abs(kv[:, :, 0]).max(axis=2, keepdims=True)
    v_range = np.abs(kv[:, :, 1]).max(axis=4, keepdims=True)
    err_k, err_v = np.abs(got - kv)[:, :, 0], np.abs(got - kv)[:, :, 1]
    if mode == "int8":
        assert (err_k <= k_range / 127 / 2 * (1 + 2**-7) + 1e-7).all()
        assert (err_v <= v_range / 127 / 2 * (1 + 2**-7) + 1e-7).all()
    else:
        assert (err_k <= np.abs(kv[:, :, 0]) / 16 + k_range / 448 / 1024 + 1e-7).all()
        assert (err_v <= np.abs(kv[:, :, 1]) / 16 + v_range / 448 / 1024 + 1e-7).all()
    rel_rms = np.sqrt(((got - kv) ** 2).sum() / (kv**2).sum())
    assert rel_rms < {"int8": 0.01, "fp8_e4m3": 0.04}[mode]
    engine.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_a_damaged_quantized_nvme_block_is_a_miss(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any, keyed: bool
) -> None:
    """The first block of the prefix damaged: nothing after it can land, so the request is
    computed from scratch, with exactly the no-cache tokens."""
    key = tmp_path / "key"
    key.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    folder = tmp_path / "nvme"
    tiers = TierConfig(
        nvme_path=str(folder),
        nvme_mb=1,
        nvme_codec="int8",
        plan="fetch",
        tier_key_file=str(key) if keyed else None,
    )
    engine = make_engine(tiny_llama_dir, tiers)
    run(engine, A)
    engine.pool.reset_cache()
    assert engine.tiering is not None
    nvme = engine.tiering.manager.tier("nvme")
    nvme.flush()  # type: ignore[attr-defined]
    files = {p.name.split("-")[0]: p for p in folder.iterdir()}
    first = files[_chain(engine, A)[0].hex()]
    data = bytearray(first.read_bytes())
    data[len(data) // 3] ^= 0x08  # in the codes
    first.write_bytes(bytes(data))
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage.get("nvme", 0) == 0
    assert engine.tiering.stats.failed_blocks == 12
    assert nvme.stats.unverified == (1 if keyed else 0)  # a bad MAC is told from damage
    check(engine)
    engine.close()


@pytest.mark.parametrize("kind", ["dram", "nvme"])
def test_raw_tiers_give_exactly_the_no_cache_tokens(
    tiny_llama_dir: Path, tmp_path: Path, expected: Any, kind: str
) -> None:
    tiers = (
        TierConfig(dram_mb=1, dram_codec="raw", plan="fetch")
        if kind == "dram"
        else TierConfig(nvme_path=str(tmp_path), nvme_mb=1, nvme_codec="raw", plan="fetch")
    )
    engine = make_engine(tiny_llama_dir, tiers)
    assert run(engine, A)[0] == expected(A)
    engine.pool.reset_cache()
    tokens, usage = run(engine, B)
    assert tokens == expected(B) and usage[kind] == 12 * BS
    check(engine)
    engine.close()
