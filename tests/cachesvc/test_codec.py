"""Codec: exact round trips in every mode and dtype; any damage, a wrong key or another model's
block decodes to None (a miss), never to wrong KV."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.codec import DTYPES, MODES, Codec, header_size, shuffle
from cachesvc.types import BlockHash

FP = "0123456789abcdef" * 2
H = BlockHash(b"h" * 16)
PARENT = BlockHash(b"p" * 16)
SHAPE = (2, 2, 4, 3, 8)  # layers, K/V, block size, kv heads, head dim


def kv_like(dtype: str, seed: int = 0, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """Gaussian values with per-channel scales, like real K/V, in `dtype`'s storage dtype."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    scales = torch.rand(shape[-1], generator=gen) * 4
    values = torch.randn(shape, generator=gen) * scales
    data = values.to(
        {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    )
    if dtype == "bfloat16":
        return data.view(torch.int16).numpy().view(np.uint16)
    return data.numpy()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round_trip_is_exact(mode: str, dtype: str) -> None:
    codec = Codec(FP, mode)
    array = kv_like(dtype)
    blob = codec.encode(H, PARENT, dtype, array)
    block = codec.decode(blob, H)
    assert block is not None
    assert block.dtype == dtype and block.parent == PARENT and block.block_hash == H
    assert block.array.dtype == array.dtype and block.array.shape == array.shape
    assert block.array.tobytes() == array.tobytes()
    assert block.array.flags.writeable  # torch.from_numpy needs no copy and gives no warning


def test_first_block_has_no_parent() -> None:
    codec = Codec(FP)
    block = codec.decode(codec.encode(H, None, "float32", kv_like("float32")), H)
    assert block is not None and block.parent is None


@pytest.mark.parametrize("mode", MODES)
def test_any_flipped_byte_is_a_miss(mode: str) -> None:
    codec = Codec(FP, mode)
    blob = codec.encode(H, PARENT, "bfloat16", kv_like("bfloat16"))
    for pos in range(0, len(blob), max(1, len(blob) // 97)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x10
        assert codec.decode(bytes(damaged), H) is None, f"flip at byte {pos} went unnoticed"
    assert codec.num_rejected > 0


@given(st.data())
@settings(max_examples=50, deadline=None)
def test_random_damage_is_a_miss(data: st.DataObject) -> None:
    codec = Codec(FP, data.draw(st.sampled_from(MODES)))
    blob = codec.encode(H, None, "float16", kv_like("float16", seed=data.draw(st.integers(0, 9))))
    pos = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    damaged = bytearray(blob)
    damaged[pos] ^= 1 << bit
    assert codec.decode(bytes(damaged), H) is None


def test_truncated_padded_and_garbage_blobs_are_misses() -> None:
    codec = Codec(FP, "shuffle_lz4")
    blob = codec.encode(H, None, "float32", kv_like("float32"))
    for bad in (blob[:-1], blob[: len(blob) // 2], blob[:10], b"", blob + b"\0", b"garbage" * 50):
        assert codec.decode(bad, H) is None


def test_another_key_or_model_is_a_miss() -> None:
    blob = Codec(FP).encode(H, None, "float32", kv_like("float32"))
    assert Codec(FP).decode(blob, BlockHash(b"x" * 16)) is None
    assert Codec("f" * 32).decode(blob, H) is None


def test_any_codec_of_the_model_decodes_any_mode() -> None:
    array = kv_like("bfloat16", shape=(4, 2, 16, 4, 64))
    blob = Codec(FP, "shuffle_lz4").encode(H, None, "bfloat16", array)
    raw = Codec(FP, "raw")
    assert raw.decode(blob, H) is not None
    again = raw.transcode(blob, H)
    assert again is not None and len(again) > len(blob)  # raw is bigger than shuffled + lz4
    assert raw.transcode(again, H) is again  # already in its mode: no work


def test_shuffle_makes_lz4_pay_on_kv_like_data() -> None:
    """Plain lz4 finds almost nothing in float KV; byte planes expose the exponent bytes (on
    synthetic data the gain is small; `cachesvc bench tiers` measures real KV)."""
    array = kv_like("bfloat16", shape=(8, 2, 16, 4, 64))
    lz4 = len(Codec(FP, "lz4").encode(H, None, "bfloat16", array))
    shuffled = len(Codec(FP, "shuffle_lz4").encode(H, None, "bfloat16", array))
    assert shuffled < 0.95 * lz4


def test_incompressible_blocks_are_stored_raw() -> None:
    noise = np.random.default_rng(0).integers(0, 2**16, SHAPE, dtype=np.uint16)
    blob = Codec(FP, "shuffle_lz4").encode(H, None, "bfloat16", noise)
    assert len(blob) == noise.nbytes + header_size(len(SHAPE))


def test_shuffle_groups_byte_planes() -> None:
    data = np.array([0x0102, 0x0304], dtype="<u2").tobytes()
    assert shuffle(data, 2) == bytes([0x02, 0x04, 0x01, 0x03])


def test_wrong_storage_dtype_is_refused() -> None:
    with pytest.raises(ValueError):
        Codec(FP).encode(H, None, "bfloat16", np.zeros(SHAPE, dtype=np.float32))
    with pytest.raises(ValueError):
        Codec(FP, "zstd")
