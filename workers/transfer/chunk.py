"""A chunk of KV on the wire between workers: one buffer of consecutive blocks and its digest.

The holder gathers a run of blocks into one contiguous array `[num_blocks, layers, ...]` (the
storage dtype of the cache: uint16 bits for bfloat16) and sends it as a numpy array, which Ray
moves out of band through its object store (no pickling of the bytes; the puller reads it in
place) or, to a puller on its own node, leaves in a shared-memory slot the puller reads in place
(`slots`). The chunk carries no hashes: the puller derives the hash chain under its own salt and
checks the digest against *its* hashes, so a chunk of another prompt, position or tenant (or a
damaged one) is refused.

The digest is keyed (a BLAKE2b MAC, keyed from the tier key when the deployment has one) over
the chunk's identity — model, block position, hashes, dtype, shape — and over its payload:

- `fast` (default): over a 128-bit xxh3 of the payload (~20 GB/s on one core here). It catches
  corruption, truncation, a misplaced or swapped chunk at memory speed, but xxh3 is no
  cryptographic hash: a forger who can write into the cluster's object store could craft a
  payload with the same checksum.
- `strict`: the MAC runs over the payload itself (~0.7 GB/s on one core here): for clusters
  whose object store is not trusted, at a cost per GB that `cachesvc bench kv-transfer` prints.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from cachesvc.kv.types import BlockHash
from workers.transfer.slots import SlotRef

DIGESTS = ("fast", "strict")
_TAG = b"cachesvc/kv-chunk/v1"
_KEY_CONTEXT = b"cachesvc peer chunk key v1"
_NO_KEY = b""


@dataclass(frozen=True)
class KVChunk:
    """Blocks `start_block .. start_block + len(payload) - 1` of a prompt, as a holder sends
    them; `payload` is `[num_blocks, *block_shape]` in `dtype`'s storage dtype. An empty chunk
    (no rows) says the holder has none of them (or refused)."""

    start_block: int
    dtype: str
    payload: np.ndarray
    digest: bytes
    lossy: bool = False  # decoded from a quantized tier: land it marked, never as exact KV
    # On the wire the payload may travel apart, as a Ray object of its own (`ray_link`): the
    # holder puts it off its loop, the puller reads it in place; or, between processes of one
    # node, in a slot of the holder's (`slot_reader` reads it in place).
    payload_ref: Any = None
    slot: SlotRef | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.payload.shape[0]) if self.payload.ndim else 0


def chunk_key(tier_key: bytes | None) -> bytes:
    """The digest key derived from the deployment's tier key (its own context, so a chunk's MAC
    is never a valid block MAC); empty without a tier key (the digest is then a checksum)."""
    return _NO_KEY if tier_key is None else hmac.digest(tier_key, _KEY_CONTEXT, "sha256")


def chunk_digest(
    key: bytes,
    mode: str,
    fingerprint: str,
    start_block: int,
    hashes: Sequence[BlockHash],
    dtype: str,
    payload: np.ndarray,
    lossy: bool = False,
) -> bytes:
    """The digest of a chunk whose blocks are `hashes`. Pure; releases the GIL on big payloads
    (hashlib and xxhash do), so it runs beside the engine's step, never on its loop."""
    if mode not in DIGESTS:
        raise ValueError(f"chunk digest must be one of {DIGESTS}, got {mode!r}")
    mac = hashlib.blake2b(key=key, digest_size=32)
    shape = struct.pack(f"<{payload.ndim}Q", *payload.shape)
    for part in (_TAG, fingerprint.encode(), dtype.encode(), shape, b"".join(hashes)):
        mac.update(struct.pack("<Q", len(part)))
        mac.update(part)
    mac.update(struct.pack("<QB", start_block, int(lossy)))
    data = np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data  # a view, no copy
    mac.update(data if mode == "strict" else xxhash.xxh3_128_digest(data))
    return mac.digest()


def verify_chunk(
    chunk: KVChunk,
    key: bytes,
    mode: str,
    fingerprint: str,
    hashes: Sequence[BlockHash],
    block_shape: tuple[int, ...],
) -> bool:
    """Whether `chunk` holds exactly the blocks `hashes[: chunk.num_blocks]` of this model, in
    this worker's cache layout. Never raises on a malformed chunk."""
    try:
        n = chunk.num_blocks
        if n > len(hashes) or tuple(chunk.payload.shape[1:]) != block_shape:
            return False
        want = chunk_digest(
            key,
            mode,
            fingerprint,
            chunk.start_block,
            hashes[:n],
            chunk.dtype,
            chunk.payload,
            chunk.lossy,
        )
        return hmac.compare_digest(want, chunk.digest)
    except (ValueError, TypeError, AttributeError, struct.error):
        return False
