"""Codec: exact round trips in every lossless mode and dtype, bounded errors in the quantized
ones; any damage, a wrong key or another model's block decodes to None (a miss), never to wrong
KV; with a tier key, only blocks signed under it decode (a forged, unsigned, other-key or
old-version block is a miss); lossy KV never leaves under a lossless mode, `transcode`
included, and a quantized block decodes marked lossy."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.kv.byte_planes import shuffle
from cachesvc.kv.codec import (
    DTYPES,
    LOSSLESS_MODES,
    MODES,
    QUANTIZED_CODECS,
    AuthError,
    Codec,
    CodecError,
    LossyKVError,
    header_size,
    is_lossy,
)
from cachesvc.kv.types import BlockHash

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


@pytest.mark.parametrize("mode", LOSSLESS_MODES)
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


def test_any_codec_of_the_model_decodes_any_lossless_mode() -> None:
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


# ---- signed blocks ------------------------------------------------------------------------------

KEY = b"k" * 32
OTHER_KEY = b"o" * 40


def _forge(blob: bytes) -> bytes:
    """What anyone who can write a tier can do to a checksummed block: change its KV and
    recompute the checksum (the result is a valid unsigned block)."""
    block = Codec(FP).decode(blob, H)
    assert block is not None
    changed = block.array.copy()
    changed.flat[0] += 1
    return Codec(FP).encode(H, block.parent, block.dtype, changed)


@pytest.mark.parametrize("mode", LOSSLESS_MODES)
def test_signed_round_trip_is_exact(mode: str) -> None:
    codec = Codec(FP, mode, KEY)
    array = kv_like("bfloat16")
    block = codec.decode(codec.encode(H, PARENT, "bfloat16", array), H)
    assert block is not None and block.parent == PARENT
    assert block.array.tobytes() == array.tobytes()


def test_a_signed_block_carries_a_mac_in_place_of_the_checksum() -> None:
    noise = np.random.default_rng(0).integers(0, 2**16, SHAPE, dtype=np.uint16)
    blob = Codec(FP, "shuffle_lz4", KEY).encode(H, None, "bfloat16", noise)
    assert len(blob) == noise.nbytes + header_size(len(SHAPE), signed=True)
    assert header_size(len(SHAPE), signed=True) == header_size(len(SHAPE)) + 24


def test_a_forged_block_passes_the_checksum_but_not_the_key() -> None:
    honest = Codec(FP).encode(H, None, "float32", kv_like("float32"))
    forged = _forge(honest)
    assert Codec(FP).decode(forged, H) is not None  # why a checksum is not enough
    keyed = Codec(FP, "raw", KEY)
    assert isinstance(keyed.verify(forged, H), AuthError)  # unsigned: refused
    assert keyed.num_rejected == 1


def test_a_changed_signed_block_or_another_key_is_refused() -> None:
    signed = Codec(FP, "raw", KEY).encode(H, PARENT, "float32", kv_like("float32"))
    changed = bytearray(signed)
    changed[-1] ^= 0x01  # payload changed, MAC kept
    for codec, blob in [
        (Codec(FP, "raw", KEY), bytes(changed)),
        (Codec(FP, "raw", OTHER_KEY), signed),  # signed under another key
        (Codec(FP), signed),  # no key to check it with: not served unchecked
    ]:
        assert isinstance(codec.verify(blob, H), AuthError)
        assert codec.decode(blob, H) is None


def test_damage_is_told_apart_from_a_bad_signature() -> None:
    blob = Codec(FP).encode(H, None, "float32", kv_like("float32"))
    outcome = Codec(FP).verify(blob[:-1], H)
    assert isinstance(outcome, CodecError) and not isinstance(outcome, AuthError)


def test_old_version_blocks_are_misses() -> None:
    blob = bytearray(Codec(FP).encode(H, None, "float32", kv_like("float32")))
    struct.pack_into("<H", blob, 4, 1)  # version 1, checksum recomputed: a well-formed v1 block
    offset = header_size(len(SHAPE)) - 8
    checksum = xxhash.xxh3_64(bytes(blob[:offset]))
    checksum.update(bytes(blob[offset + 8 :]))
    struct.pack_into("<Q", blob, offset, checksum.intdigest())
    assert Codec(FP).decode(bytes(blob), H) is None
    assert Codec(FP, "raw", KEY).decode(bytes(blob), H) is None


def test_transcode_signs_a_checksummed_block_from_its_source_tier() -> None:
    dram, nvme = Codec(FP, "raw"), Codec(FP, "raw", KEY)
    blob = dram.encode(H, PARENT, "bfloat16", kv_like("bfloat16"))
    signed = nvme.transcode(blob, H, source=dram)
    assert signed is not None and nvme.decode(signed, H) is not None
    assert nvme.transcode(signed, H) is signed  # already in its mode and signed: no work
    assert nvme.transcode(_forge(blob), H) is None  # verified by the source: unsigned refused
    assert Codec(FP, "raw", KEY).with_mode("lz4").decode(signed, H) is not None


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Codec(FP, "raw", b"short")


# ---- quantized blocks ---------------------------------------------------------------------------

QUANTIZED = ("int8", "fp8_e4m3")
KV_SHAPE = (3, 2, 16, 2, 32)  # layers, K/V, block size, kv heads, head dim


def _as_float64(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return array.astype(np.float64)


def _range(x: np.ndarray) -> np.ndarray:
    """Each value's quantization range: K's channel over the block's tokens, V's token over
    head_dim (the codec's scale times the largest code)."""
    k_range = np.abs(x[:, 0]).max(axis=1, keepdims=True) * np.ones_like(x[:, 0])
    v_range = np.abs(x[:, 1]).max(axis=3, keepdims=True) * np.ones_like(x[:, 1])
    return np.stack([k_range, v_range], axis=1)


def _error_bound(mode: str, dtype: str, x: np.ndarray) -> np.ndarray:
    """Half a step of the code at each value (its scale rounded up to bfloat16: by at most
    2**-7), plus the rounding of the decoded value into `dtype`."""
    scale = _range(x) * (1 + 2**-7)
    # fp8: 3 mantissa bits, so half a step is 2**-4 of the value; subnormals 2**-9 of the scale.
    fp8 = np.abs(x) * 2**-4 + scale / 448 * 2**-10
    step = scale / 127 / 2 if mode == "int8" else fp8
    rounding = {"float32": 2**-24, "float16": 2**-11, "bfloat16": 2**-8}[dtype]
    return step * (1 + 1e-6) + (np.abs(x) + step) * rounding


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("signed", [False, True])
def test_quantized_round_trip_is_within_half_a_step(mode: str, dtype: str, signed: bool) -> None:
    codec = Codec(FP, mode, KEY if signed else None)
    array = kv_like(dtype, seed=3, shape=KV_SHAPE)
    blob = codec.encode(H, PARENT, dtype, array)
    block = codec.decode(blob, H)
    assert block is not None and block.parent == PARENT and block.dtype == dtype
    assert block.array.dtype == array.dtype and block.array.shape == array.shape
    assert block.array.flags.writeable
    x, got = _as_float64(array, dtype), _as_float64(block.array, dtype)
    assert (np.abs(got - x) <= _error_bound(mode, dtype, x)).all()
    # One byte per value and 2 bytes per scale: 4x smaller than float32, but for the scales.
    assert len(blob) == codec.max_blob_size(dtype, KV_SHAPE) < array.size + array.size // 4 + 200


@pytest.mark.parametrize("mode", QUANTIZED)
def test_an_outlier_channel_of_k_or_token_of_v_keeps_to_itself(mode: str) -> None:
    """K per channel, V per token: a channel of K (or a token of V) 100x larger than the rest
    costs the other channels (tokens) no precision, which one scale per block would."""
    x = kv_like("float32", seed=4, shape=KV_SHAPE) / 4
    x[:, 0, :, :, 5] *= 100  # K channel 5 in every token
    x[:, 1, 7] *= 100  # V of token 7
    codec = Codec(FP, mode)
    block = codec.decode(codec.encode(H, None, "float32", x), H)
    assert block is not None
    error = np.abs(block.array - x)
    typical = np.abs(x).max() / 100
    assert error[:, 0, :, :, :5].max() < typical / 10
    assert error[:, 1, :7].max() < typical / 10


@pytest.mark.parametrize("mode", QUANTIZED)
def test_zeros_stay_zeros(mode: str) -> None:
    codec = Codec(FP, mode)
    zeros = np.zeros(KV_SHAPE, dtype=np.uint16)
    block = codec.decode(codec.encode(H, None, "bfloat16", zeros), H)
    assert block is not None and not block.array.any()


def test_fp8_codes_are_torch_float8_e4m3fn() -> None:
    """The numpy cast (round to nearest even) and the decode table against torch's own."""
    import torch

    from cachesvc.kv.quantize import _FP8_VALUES, _to_fp8

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    values = bits[np.isfinite(bits) & (np.abs(bits) <= 448)]
    finite = np.sort(_FP8_VALUES[np.isfinite(_FP8_VALUES)])
    ties = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    values = np.concatenate([values, ties, finite, rng.standard_normal(1000).astype(np.float32)])
    expected = torch.from_numpy(values).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    np.testing.assert_array_equal(_to_fp8(values.copy()), expected)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(_FP8_VALUES, table)


@pytest.mark.parametrize("mode", QUANTIZED)
@pytest.mark.parametrize("key", [None, KEY])
def test_a_damaged_quantized_block_is_a_miss(mode: str, key: bytes | None) -> None:
    """Every byte counts: the header with its scales, the tag, the codes."""
    codec = Codec(FP, mode, key)
    blob = codec.encode(H, PARENT, "float16", kv_like("float16", shape=KV_SHAPE))
    for pos in range(0, len(blob), max(1, len(blob) // 211)):
        damaged = bytearray(blob)
        damaged[pos] ^= 0x04
        outcome = codec.verify(bytes(damaged), H)
        assert isinstance(outcome, CodecError), f"flip at byte {pos} went unnoticed"
    scales_at = header_size(len(KV_SHAPE))  # inside the scales, which follow the ids
    damaged = bytearray(blob)
    damaged[scales_at] ^= 0x01
    outcome = codec.verify(bytes(damaged), H)
    assert isinstance(outcome, AuthError if key else CodecError)


def test_a_forged_quantized_block_passes_the_checksum_but_not_the_key() -> None:
    honest = Codec(FP, "int8").encode(H, None, "float32", kv_like("float32", shape=KV_SHAPE))
    block = Codec(FP, "int8").decode(honest, H)
    assert block is not None
    forged = Codec(FP, "int8").encode(H, None, "float32", block.array * 2)
    assert Codec(FP, "int8").decode(forged, H) is not None
    assert isinstance(Codec(FP, "int8", KEY).verify(forged, H), AuthError)


def test_only_a_codec_of_the_same_quantized_mode_serves_a_quantized_block() -> None:
    """A tier configured lossless never hands out lossy KV; a quantized one reads lossless."""
    array = kv_like("float32", shape=KV_SHAPE)
    blob = Codec(FP, "int8").encode(H, None, "float32", array)
    for mode in (*LOSSLESS_MODES, "fp8_e4m3"):
        assert isinstance(Codec(FP, mode).verify(blob, H), CodecError)
    lossless = Codec(FP, "shuffle_lz4").encode(H, None, "float32", array)
    block = Codec(FP, "int8").decode(lossless, H)
    assert block is not None and block.array.tobytes() == array.tobytes()


def test_versions_say_whether_a_block_is_quantized() -> None:
    array = kv_like("float32", shape=KV_SHAPE)
    assert struct.unpack_from("<H", Codec(FP).encode(H, None, "float32", array), 4) == (2,)
    blob = bytearray(Codec(FP, "fp8_e4m3").encode(H, None, "float32", array))
    assert struct.unpack_from("<H", blob, 4) == (3,)
    struct.pack_into("<H", blob, 4, 2)  # a reader of version 2 would misread it: refused
    tag_at = len(blob) - array.size - 8
    checksum = xxhash.xxh3_64(bytes(blob[:tag_at]))
    checksum.update(bytes(blob[tag_at + 8 :]))
    struct.pack_into("<Q", blob, tag_at, checksum.intdigest())
    assert Codec(FP, "fp8_e4m3").decode(bytes(blob), H) is None


def test_transcode_re_signs_a_quantized_block_without_quantizing_it_again() -> None:
    dram, nvme = Codec(FP, "int8"), Codec(FP, "int8", KEY)
    blob = dram.encode(H, PARENT, "bfloat16", kv_like("bfloat16", shape=KV_SHAPE))
    signed = nvme.transcode(blob, H, source=dram)
    num_values = int(np.prod(KV_SHAPE))
    assert signed is not None and signed[-num_values:] == blob[-num_values:]  # the same codes
    first, again = dram.decode(blob, H), nvme.decode(signed, H)
    assert first is not None and again is not None
    assert first.array.tobytes() == again.array.tobytes()


@pytest.mark.parametrize("quantized", QUANTIZED_CODECS)
def test_lossy_kv_is_never_encoded_under_a_lossless_mode(quantized: str) -> None:
    """Decoded, a quantized block says it is lossy; no lossless codec takes it (encoded or
    transcoded: stored as raw it would read back as exact KV), another quantized one does."""
    source = Codec(FP, quantized)
    blob = source.encode(H, PARENT, "bfloat16", kv_like("bfloat16", shape=KV_SHAPE))
    block = source.decode(blob, H)
    assert block is not None and block.lossy and is_lossy(blob)
    for mode in LOSSLESS_MODES:
        for key in (None, KEY):
            codec = Codec(FP, mode, key)
            with pytest.raises(LossyKVError):
                codec.transcode(blob, H, source=source)
            with pytest.raises(LossyKVError):
                codec.encode(H, PARENT, block.dtype, block.array, lossy=True)
    other = Codec(FP, "fp8_e4m3" if quantized == "int8" else "int8", KEY)
    moved = other.transcode(blob, H, source=source)
    assert moved is not None and is_lossy(moved)
    again = other.decode(moved, H)
    assert again is not None and again.lossy


def test_a_lossless_block_decodes_exact_even_from_a_quantized_tier() -> None:
    array = kv_like("float32", shape=KV_SHAPE)
    blob = Codec(FP, "raw").encode(H, None, "float32", array)
    block = Codec(FP, "int8").decode(blob, H)  # a raw blob a quantized tier adopted
    assert block is not None and not block.lossy and not is_lossy(blob)
    assert not is_lossy(b"CS")  # too short to be a block: not lossy, and decoding refuses it


def test_a_quantized_block_must_be_kv_shaped() -> None:
    with pytest.raises(ValueError, match="layers, 2, block_size"):
        Codec(FP, "int8").encode(H, None, "float32", np.zeros((4, 3, 8), dtype=np.float32))
