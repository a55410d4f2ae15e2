"""Rolling block hashes: the routing key is the storage key.

Pure functions over token ids. Block i's hash covers its parent's hash and its own token ids
(little-endian uint32) through xxh3-128, so a hash names a whole prefix. The root covers a format
tag, the model fingerprint, the block size and the tenant salt: two models, two block sizes or two
tenants never share a hash. No `hash()`, no pickle, no per-process seed: the same input gives
the same hash in every process and after every restart.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from cachesvc.types import BlockHash

FORMAT_TAG = b"cachesvc/block-hash/v1"
HASH_BYTES = 16
_MAX_TOKEN = 2**32 - 1


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


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Hash of one block given its parent's hash; raises ValueError on ids outside uint32."""
    if any(t < 0 or t > _MAX_TOKEN for t in token_ids):
        raise ValueError("token ids must fit in uint32")
    return BlockHash(
        xxhash.xxh3_128_digest(parent + struct.pack(f"<{len(token_ids)}I", *token_ids))
    )


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
    the number of hashed blocks as `start_block`. A partial last block is not hashed.
    """
    if start_block and parent is None:
        raise ValueError("continuing from start_block > 0 needs the parent hash")
    prev = root if parent is None else parent
    out: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        prev = block_hash(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out
