"""Rolling block hashes: the routing key is the storage key.

Pure functions over token ids. Block i's hash covers its parent's hash and its own token ids
(little-endian uint32) through xxh3-128, so a hash names a whole prefix. The root covers a format
tag, the model fingerprint, the block size and the tenant salt: two models, two block sizes or two
tenants never share a hash. No `hash()`, no pickle, no per-process seed: the same input gives
the same hash in every process and after every restart.

A purge makes every block cached before it unreachable at once by moving the service to a new
purge epoch, which the router folds into the salt it sends with each request (`epoch_salt`):
every hash is new from then on, on every worker, peer and shared tier alike, whatever still
holds the old blocks. Epoch 0 leaves the salt as it is, so a service never purged keeps its
hashes.
"""

from __future__ import annotations

import array
import secrets
import struct
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

from cachesvc.kv.types import BlockHash

FORMAT_TAG = b"cachesvc/block-hash/v1"
# Salts that start with this carry a purge epoch; the router refuses it in a client's salt.
PURGE_SALT_PREFIX = "purge:"
HASH_BYTES = 16
# array's "I" is a 4-byte unsigned int on every platform numpy and torch support; the bytes
# hashed are little-endian everywhere.
assert array.array("I").itemsize == 4
_SWAP = sys.byteorder == "big"


def _field(data: bytes) -> bytes:
    # Length-prefixed, so no two different field lists serialise to the same bytes.
    return struct.pack("<I", len(data)) + data


def root_hash(model_fingerprint: str, block_size: int, salt: str | bytes = b"") -> BlockHash:
    """The parent of a sequence's first block."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt)
    payload = b"".join(
        (
            _field(FORMAT_TAG),
            _field(model_fingerprint.encode()),
            _field(struct.pack("<I", block_size)),
            _field(salt_bytes),
        )
    )
    return BlockHash(xxhash.xxh3_128_digest(payload))


def epoch_salt(salt: str | None, epoch: int) -> str | None:
    """The salt a request's blocks are hashed under at purge epoch `epoch`: `salt` itself at
    epoch 0, else `purge:<epoch>/<salt>`.

    No two (salt, epoch) pairs give the same string as long as no salt of its own starts with
    `PURGE_SALT_PREFIX` (the digits end at the first "/"), so no epoch reaches another's
    blocks. None (no salt) stays None at epoch 0, as the workers hash it like "".
    """
    if epoch < 0:
        raise ValueError(f"a purge epoch is never negative, got {epoch}")
    if epoch == 0:
        return salt
    return f"{PURGE_SALT_PREFIX}{epoch}/{salt or ''}"


def unshared_salt(salt: str | None) -> str:
    """A salt of one request alone, for when the purge epoch cannot be read: its blocks meet
    no block of any epoch nor of another request (`purge:unread-<random>/<salt>`; no epoch's
    digits start with a letter), so it reuses nothing that a purge may have ended."""
    return f"{PURGE_SALT_PREFIX}unread-{secrets.token_hex(16)}/{salt or ''}"


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash; raises ValueError on ids outside uint32."""
    return BlockHash(xxhash.xxh3_128_digest(parent + _pack(token_ids)))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    root: BlockHash,
    *,
    start_block: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start_block` on.

    Continuing an earlier call (a request that grew) passes the last known hash as `parent` and
    the number of hashed blocks as `start_block`. A partial last block is not hashed. Raises
    ValueError on ids outside uint32.
    """
    if start_block and parent is None:
        raise ValueError("continuing from start_block > 0 needs the parent hash")
    prev = root if parent is None else parent
    num_blocks = len(token_ids) // block_size
    if num_blocks <= start_block:
        return []
    # Packed once, checked once; then one digest per block over a slice of the bytes.
    data = _pack(token_ids[start_block * block_size : num_blocks * block_size])
    stride = 4 * block_size
    digest = xxhash.xxh3_128_digest
    out: list[BlockHash] = []
    for offset in range(0, len(data), stride):
        prev = BlockHash(digest(prev + data[offset : offset + stride]))
        out.append(prev)
    return out


def _pack(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; raises ValueError on ids outside uint32."""
    if isinstance(token_ids, np.ndarray):
        token_ids = token_ids.tolist()
    try:
        # array checks every id's range in C, far faster than a Python loop or numpy's copy.
        packed = array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError("token ids must fit in uint32") from exc
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()
