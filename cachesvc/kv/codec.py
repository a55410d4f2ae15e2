"""Block <-> bytes for every off-device tier: a versioned, checksummed or signed header, then the
payload.

Layout (little-endian): magic `CSKV`, version, flags, dtype code, ndim, shape, model fingerprint
(16 bytes), block hash (16), parent hash (16, zeros for a first block), raw payload length,
stored payload length, a quantized block's scales, then a tag over everything before it *and*
the payload: an xxh3-64 checksum (8 bytes), or with a deployment key (`FLAG_SIGNED`) an
HMAC-SHA256 (32 bytes).
A flipped byte anywhere, a truncated blob, another model's block or another block under this key
all fail `decode`, which answers None: a miss, never wrong KV. Never pickle.

A checksum catches damage, not forgery: whoever can write an NVMe file or a Redis key can change
a block and recompute it. A codec with a key signs every block it encodes and accepts only blocks
signed under that key; an unsigned block, one signed under another key, or a signed one when it
has no key to check it with are refused as `AuthError` (counted apart from damage). HMAC-SHA256
runs at ~1.7 GB/s here (SHA extensions), keyed BLAKE2b at ~0.7 GB/s.

Compression modes (chosen per tier): `raw`; `lz4`; `shuffle_lz4` (byte-plane shuffle, then lz4).
Plain lz4 barely compresses float KV (measured 1.02x on SmolLM2); splitting the bytes of each
value into planes puts the low-entropy exponent bytes together, which lz4 then finds (1.18x
float32, 1.40x bf16). A block whose compressed form is not smaller is stored uncompressed.

Quantized modes (opt-in per tier: they change what the model computes): `int8` and `fp8_e4m3`
store one byte per value plus scales, in the header of a version-3 block (the version only
quantized blocks use: blocks already stored stay readable, and a reader that predates
quantization refuses them by version). A block must be laid out `[layers, 2 (K/V), block_size,
kv_heads, head_dim]`. Scales follow KIVI (arXiv 2402.02750): K per channel (one scale per layer,
head and channel, over the block's tokens), since some channels of K are much larger than the
rest in every token (on SmolLM2 a head's largest channel is ~4x its median one) and a per-token
scale would spend the range on them; V per token (one per layer, token and head, over
head_dim), since V has no such channels and attention mixes whole V rows, so each row's error
should be relative to that row. Of the four per-channel / per-token choices this one gives the
smallest logit error on SmolLM2 (`docs/benchmarks/tiers.md`, its history). Scales are bfloat16
bits rounded up:
float32's range in 2 bytes, and |x / scale| never exceeds the code's maximum, so nothing clips;
values are quantized against the stored scale itself.
Decoding gives the block back in its own dtype. A codec serves quantized blocks only of its own
mode: a tier configured lossless never hands out lossy KV another configuration wrote.

A block decoded from a quantized blob is lossy (`KVBlock.lossy`), and no lossless codec encodes
lossy KV (`LossyKVError`, `transcode` included): stored losslessly it would read back as exact.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import NamedTuple

import lz4.block
import numpy as np
import xxhash

from cachesvc.kv.byte_planes import compress, decompress
from cachesvc.kv.config import MIN_TIER_KEY_BYTES, QUANTIZED_CODECS
from cachesvc.kv.quantize import dequantize, num_scales, quantize
from cachesvc.kv.types import BlockHash

MAGIC = b"CSKV"
VERSION = 2  # 2: the tag is a checksum or a MAC (FLAG_SIGNED); version 1 blocks are misses
QUANT_VERSION = 3  # 3: a quantized block, with its scales in the header
LOSSLESS_MODES = ("raw", "lz4", "shuffle_lz4")
MODES = (*LOSSLESS_MODES, *QUANTIZED_CODECS)
FLAG_SHUFFLE = 1
FLAG_LZ4 = 2
FLAG_SIGNED = 4
FLAG_INT8 = 8
FLAG_FP8 = 16
_QUANT_FLAGS = {"int8": FLAG_INT8, "fp8_e4m3": FLAG_FP8}
_MAX_NDIM = 8
_NO_PARENT = bytes(16)
_PREFIX = struct.Struct("<4sHHBB")  # magic, version, flags, dtype code, ndim
_IDS = struct.Struct("<16s16s16sQQ")  # fingerprint, hash, parent, raw len, stored len
_CHECKSUM = struct.Struct("<Q")
_MAC_SIZE = 32  # HMAC-SHA256
# The MAC key is derived from the deployment secret, so the secret signs nothing else directly.
_KEY_CONTEXT = b"cachesvc kv block mac v2"
# numpy has no bfloat16: its bits travel as uint16 and the caller reinterprets them.
DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (1, np.dtype(np.float32)),
    "float16": (2, np.dtype(np.float16)),
    "bfloat16": (3, np.dtype(np.uint16)),
}
_BY_CODE = {code: (name, dt) for name, (code, dt) in DTYPES.items()}
Buffer = bytes | bytearray | memoryview  # a blob, or a view of a tier's memory


class CodecError(ValueError):
    """Not a valid block of this model under this hash (`decode` turns it into None)."""


class LossyKVError(ValueError):
    """Lossy KV handed to a lossless codec (callers check `Codec.lossless` first)."""


class AuthError(CodecError):
    """Not signed by this deployment's key: unsigned where a key is configured, signed under
    another key or changed since, or signed where no key is configured to check it."""


@dataclass(frozen=True)
class KVBlock:
    """One block's KV across all layers, decoded and verified.

    `array` has the storage dtype of `dtype` (uint16 bits for bfloat16). `lossy`: the KV is not
    what the model computes (dequantized, or computed over such KV); only a quantized codec
    stores it.
    """

    block_hash: BlockHash
    parent: BlockHash | None
    dtype: str
    array: np.ndarray
    lossy: bool = False


def fingerprint_bytes(fingerprint: str) -> bytes:
    """The 16 header bytes naming a model (its fingerprint is 32 hex characters)."""
    try:
        raw = bytes.fromhex(fingerprint)
    except ValueError:
        raw = xxhash.xxh3_128_digest(fingerprint.encode())
    return raw if len(raw) == 16 else xxhash.xxh3_128_digest(raw)


def header_size(ndim: int, signed: bool = False) -> int:
    """Bytes a blob of an `ndim` array adds to its payload (a signed one carries a longer tag),
    besides a quantized block's scales."""
    return _PREFIX.size + 4 * ndim + _IDS.size + (_MAC_SIZE if signed else _CHECKSUM.size)


def max_blob_size(mode: str, dtype: str, shape: tuple[int, ...], signed: bool = False) -> int:
    """The most bytes a block of `shape` encodes to in `mode` (a quantized block: exactly)."""
    num_values = int(np.prod(shape))
    if mode in QUANTIZED_CODECS:
        return header_size(len(shape), signed) + 2 * num_scales(shape) + num_values
    return header_size(len(shape), signed) + num_values * DTYPES[dtype][1].itemsize


class Codec:
    """Encodes blocks of one model with one mode; decodes any lossless mode of that model, and
    quantized blocks of its own mode.

    With `key` (the deployment secret, at least `MIN_TIER_KEY_BYTES`) every block is signed and only
    blocks signed under that key decode; without it blocks carry a checksum and signed ones are
    refused. Thread-safe: it holds no mutable state besides the failure counters.
    """

    def __init__(self, fingerprint: str, mode: str = "raw", key: bytes | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"codec mode must be one of {MODES}, got {mode!r}")
        if key is not None and len(key) < MIN_TIER_KEY_BYTES:
            raise ValueError(f"a tier key needs {MIN_TIER_KEY_BYTES} bytes or more, got {len(key)}")
        self.fingerprint = fingerprint_bytes(fingerprint)
        self.mode = mode
        self.num_rejected = 0  # blobs that failed verification (a metric)
        self._fingerprint_text = fingerprint
        self._key = key
        mac_key = None if key is None else hmac.digest(key, _KEY_CONTEXT, "sha256")
        self._mac = None if mac_key is None else hmac.new(mac_key, digestmod="sha256")

    @property
    def signed(self) -> bool:
        return self._mac is not None

    @property
    def lossless(self) -> bool:
        """Whether a block decodes to exactly the KV that was encoded (not quantized)."""
        return self.mode in LOSSLESS_MODES

    def with_mode(self, mode: str) -> Codec:
        """A codec of the same model and key that encodes with `mode`."""
        return Codec(self._fingerprint_text, mode, self._key)

    def max_blob_size(self, dtype: str, shape: tuple[int, ...]) -> int:
        """The most bytes this codec encodes a block of `shape` to."""
        return max_blob_size(self.mode, dtype, shape, self.signed)

    def encode(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        dtype: str,
        array: np.ndarray,
        lossy: bool = False,
    ) -> bytes:
        """The blob of a block; `array` must already have `dtype`'s storage dtype (and, to be
        quantized, the `[layers, 2, block_size, kv_heads, head_dim]` layout). Raises
        LossyKVError for `lossy` KV in a lossless mode."""
        if lossy and self.lossless:
            raise LossyKVError(f"lossy KV of {block_hash.hex()} under the lossless {self.mode}")
        code, storage = DTYPES[dtype]
        if array.dtype != storage or array.ndim > _MAX_NDIM:
            raise ValueError(f"array of {array.dtype}/{array.ndim}d does not fit dtype {dtype}")
        version, scales = VERSION, b""
        payload: bytes | memoryview
        if self.mode in QUANTIZED_CODECS:
            scales, payload = quantize(array, dtype, self.mode)
            version, flags = QUANT_VERSION, _QUANT_FLAGS[self.mode]
        else:
            raw = np.ascontiguousarray(array).data.cast("B")  # a view, no copy
            payload, flags = self._compress(raw, storage.itemsize)
        if self.signed:
            flags |= FLAG_SIGNED
        head = _PREFIX.pack(MAGIC, version, flags, code, array.ndim)
        head += struct.pack(f"<{array.ndim}I", *array.shape)
        head += _IDS.pack(
            self.fingerprint, block_hash, parent or _NO_PARENT, array.nbytes, len(payload)
        )
        head += scales
        return b"".join((head, self._tag(head, payload), payload))

    def transcode(
        self, blob: bytes, expect_hash: BlockHash, source: Codec | None = None
    ) -> bytes | None:
        """Re-encode a blob in this codec's mode and signing (unchanged when already in them);
        None if invalid. `source` is the codec of the tier the blob comes from (default: this
        one), which verifies it: a checksummed DRAM blob is signed on its way to NVMe. A blob
        already in this mode only changes its tag: a quantized block is never quantized twice.
        Raises LossyKVError for a quantized blob and a lossless mode (see `is_lossy`)."""
        block = (source or self).decode(blob, expect_hash)
        if block is None:
            return None
        flags = _flags_of(blob)
        if _mode_of(flags) != self.mode:
            b = block
            return self.encode(b.block_hash, b.parent, b.dtype, b.array, lossy=b.lossy)
        if bool(flags & FLAG_SIGNED) == self.signed:
            return blob
        return self._retag(memoryview(blob))

    def decode(self, blob: Buffer, expect_hash: BlockHash) -> KVBlock | None:
        """The verified block, or None (counted) when anything does not check out."""
        outcome = self.verify(blob, expect_hash)
        return outcome if isinstance(outcome, KVBlock) else None

    def verify(self, blob: Buffer, expect_hash: BlockHash) -> KVBlock | CodecError:
        """The verified block, or why it was refused (counted): an `AuthError` when its
        signature does not check out, another `CodecError` when it is damaged, not this
        block, or quantized in another mode than this codec's."""
        try:
            return self._decode(memoryview(blob), expect_hash)
        except CodecError as exc:
            self.num_rejected += 1
            return exc
        except (struct.error, ValueError, lz4.block.LZ4BlockError) as exc:
            self.num_rejected += 1
            return CodecError(str(exc))

    def _tag(self, head: Buffer, payload: Buffer) -> bytes:
        """The checksum, or with a key the MAC, of a header and its payload."""
        if self._mac is None:
            checksum = xxhash.xxh3_64(head)
            checksum.update(payload)
            return _CHECKSUM.pack(checksum.intdigest())
        mac = self._mac.copy()
        mac.update(head)
        mac.update(payload)
        return mac.digest()

    def _retag(self, view: memoryview) -> bytes:
        """A verified blob with this codec's signing: its header and payload as they are."""
        header = _read_header(view)
        flags = header.flags & ~FLAG_SIGNED | (FLAG_SIGNED if self.signed else 0)
        head = bytearray(view[: header.end])
        _PREFIX.pack_into(head, 0, MAGIC, header.version, flags, header.code, len(header.shape))
        payload = view[header.end + _tag_size(header.flags) :]
        return b"".join((head, self._tag(head, payload), payload))

    def _compress(self, raw: memoryview, itemsize: int) -> tuple[bytes | memoryview, int]:
        if self.mode == "raw":
            return raw, 0
        shuffled = self.mode == "shuffle_lz4"
        packed = compress(raw, itemsize, shuffled)
        if packed is None:
            return raw, 0  # does not pay for this block: store it as is
        return packed, FLAG_LZ4 | (FLAG_SHUFFLE if shuffled else 0)

    def _decode(self, view: memoryview, expect_hash: BlockHash) -> KVBlock:
        header = _read_header(view)
        signed = bool(header.flags & FLAG_SIGNED)
        tag_size = _tag_size(header.flags)
        stored_tag = view[header.end : header.end + tag_size]
        payload = view[header.end + tag_size :]
        if len(stored_tag) != tag_size or len(payload) != header.stored_len:
            raise CodecError("truncated or padded payload")
        if signed != self.signed:
            raise AuthError("signed block without a key" if signed else "unsigned block")
        tag = self._tag(view[: header.end], payload)
        if not hmac.compare_digest(tag, stored_tag):
            raise AuthError("MAC mismatch") if signed else CodecError("checksum mismatch")
        if header.fingerprint != self.fingerprint or header.block_hash != expect_hash:
            raise CodecError("block of another model or under another hash")
        mode = _mode_of(header.flags)
        if mode in QUANTIZED_CODECS and mode != self.mode:
            raise CodecError(f"a {mode} block, where this tier serves {self.mode} blocks")
        name, storage = _BY_CODE[header.code]
        num_values = int(np.prod(header.shape, dtype=np.int64))
        if header.raw_len != storage.itemsize * num_values:
            raise CodecError("payload length does not match the shape")
        if mode in QUANTIZED_CODECS:
            if header.stored_len != num_values:
                raise CodecError("quantized payload length does not match the shape")
            array = dequantize(header.scales, payload, header.shape, name, mode)
        else:
            raw = decompress(
                payload,
                header.flags & FLAG_LZ4,
                header.flags & FLAG_SHUFFLE,
                header.raw_len,
                storage.itemsize,
            )
            array = raw.view(storage).reshape(header.shape)
        parent_hash = None if header.parent == _NO_PARENT else BlockHash(header.parent)
        lossy = mode in QUANTIZED_CODECS
        return KVBlock(BlockHash(header.block_hash), parent_hash, name, array, lossy)


class _Header(NamedTuple):
    """A blob's header as read, not yet verified; the tag starts at `end`."""

    version: int
    flags: int
    code: int
    shape: tuple[int, ...]
    fingerprint: bytes
    block_hash: bytes
    parent: bytes
    raw_len: int
    stored_len: int
    scales: memoryview  # bfloat16 bits of a quantized block's scales, else empty
    end: int


def _read_header(view: memoryview) -> _Header:
    magic, version, flags, code, ndim = _PREFIX.unpack_from(view, 0)
    quantized = flags & (FLAG_INT8 | FLAG_FP8)
    if magic != MAGIC or version != (QUANT_VERSION if quantized else VERSION):
        raise CodecError("bad magic or version")
    if ndim > _MAX_NDIM or code not in _BY_CODE:
        raise CodecError("bad ndim or dtype")
    offset = _PREFIX.size
    shape = struct.unpack_from(f"<{ndim}I", view, offset)
    offset += 4 * ndim
    ids = _IDS.unpack_from(view, offset)  # fingerprint, hash, parent, raw and stored lengths
    offset += _IDS.size
    count = 0
    if quantized:
        if quantized == FLAG_INT8 | FLAG_FP8 or flags & (FLAG_LZ4 | FLAG_SHUFFLE):
            raise CodecError("bad quantization flags")
        if len(shape) != 5 or shape[1] != 2:
            raise CodecError("a quantized block that is not [layers, 2, tokens, heads, dim]")
        count = num_scales(shape)
    scales = view[offset : offset + 2 * count]
    if len(scales) != 2 * count:
        raise CodecError("truncated scales")
    return _Header._make((version, flags, code, shape, *ids, scales, offset + len(scales)))


def _tag_size(flags: int) -> int:
    return _MAC_SIZE if flags & FLAG_SIGNED else _CHECKSUM.size


def is_lossy(blob: Buffer) -> bool:
    """Whether a blob holds quantized KV, by its flags (not verified: `decode` does that)."""
    try:
        return _mode_of(_flags_of(blob)) in QUANTIZED_CODECS
    except struct.error:
        return False  # too short to be a block: decoding refuses it


def _flags_of(blob: Buffer) -> int:
    return int(_PREFIX.unpack_from(blob, 0)[2])


def _mode_of(flags: int) -> str:
    for mode, flag in _QUANT_FLAGS.items():
        if flags & flag:
            return mode
    if flags & FLAG_SHUFFLE:
        return "shuffle_lz4"
    return "lz4" if flags & FLAG_LZ4 else "raw"
