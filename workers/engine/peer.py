"""Blocks between workers: a peer exports a run of a prompt's blocks, the puller lands them.

The exporter is given the prompt's token ids and the request's cache salt, not hashes: it
computes the hashes itself under that salt, so a request can only ever be served blocks of its
own tenant (a hash of another tenant's block can not be asked for). It sends the leading run it
holds, from its device pool or its local tiers, each block in the codec's format.

The puller decodes each blob against the hash *it* computed for that position (a damaged,
foreign or misplaced block is a miss: the run stops there), writes the verified blocks into free
device blocks, registers them and lets them go, as cached blocks, so the request's own prefix
match finds them at admission. Both sides run between steps (`AsyncEngine.call`), so the blocks
read or written can not move meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachesvc.codec import Codec, KVBlock
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.types import BlockHash, BlockId
from workers.engine.engine import Engine
from workers.engine.kv_copy import read_block, write_blocks


@dataclass(frozen=True)
class PeerBlocks:
    """Encoded blocks `start_block, start_block + 1, ...` of a prompt, as a peer sent them."""

    start_block: int
    blobs: tuple[bytes, ...]


def peer_codec(engine: Engine) -> Codec:
    """The codec of blocks between workers: uncompressed, signed with the tier key when the
    deployment has one (blocks leave the process)."""
    key = engine.config.tiers.read_key() if engine.config.tiers.tier_key_file else None
    return Codec(engine.loaded.fingerprint, "raw", key)


def prompt_hashes(
    engine: Engine, token_ids: Sequence[int], cache_salt: str | None
) -> list[BlockHash]:
    """The hashes of a prompt's full blocks under `cache_salt`, as the engine's own requests
    compute them."""
    bs = engine.config.block_size
    root = root_hash(engine.loaded.fingerprint, bs, cache_salt or "")
    return hash_blocks(list(token_ids), bs, root)


def num_device_blocks(engine: Engine, token_ids: Sequence[int], cache_salt: str | None) -> int:
    """How many leading full blocks of a prompt the device pool holds now (read-only)."""
    n = 0
    for block_hash in prompt_hashes(engine, token_ids, cache_salt):
        if not engine.pool.contains(block_hash):
            break
        n += 1
    return n


@torch.inference_mode()
def export_blocks(
    engine: Engine,
    token_ids: Sequence[int],
    cache_salt: str | None,
    start_block: int,
    max_blocks: int,
) -> PeerBlocks:
    """Encode blocks `start_block .. max_blocks - 1` of a prompt that this engine holds, up to
    the first it does not hold. Does not mutate the cache (tier reads count as reads). Run it
    between steps."""
    hashes = prompt_hashes(engine, token_ids, cache_salt)[: max(0, max_blocks)]
    codec = peer_codec(engine)
    bs = engine.config.block_size
    blobs: list[bytes] = []
    for i in range(max(0, start_block), len(hashes)):
        block = _held_block(engine, hashes, i, token_ids[i * bs : (i + 1) * bs])
        if block is None:
            break
        blobs.append(codec.encode(block.block_hash, block.parent, block.dtype, block.array))
    return PeerBlocks(start_block, tuple(blobs))


def _held_block(
    engine: Engine, hashes: Sequence[BlockHash], i: int, tokens: Sequence[int]
) -> KVBlock | None:
    """Block `i` of a chain from the device pool, else from a local tier, else None."""
    parent = hashes[i - 1] if i > 0 else None
    block_id = engine.pool.lookup(hashes[i], tokens)
    if block_id is not None:
        array = read_block(engine.runner.kv_caches, block_id)
        return KVBlock(hashes[i], parent, engine.config.dtype, array)
    tiering = engine.tiering
    if tiering is None:
        return None
    local = {t.name for t in tiering.manager.local}
    held = [name for name in tiering.manager.held_locally(hashes[i]) if name in local]
    if not held:
        return None
    result = tiering.manager.read([(held[0], [hashes[i]])])
    tiering.manager.settle(result)
    return result.blocks[0] if result.blocks else None


@torch.inference_mode()
def import_blocks(
    engine: Engine, token_ids: Sequence[int], cache_salt: str | None, sent: PeerBlocks
) -> int:
    """Verify and land blocks a peer sent as cached device blocks; returns how many landed.

    Blocks the pool already holds are skipped; the run stops at the first blob that does not
    decode to this prompt's block at its position, and at the pool's free room (one block is
    kept for the token the request must compute). Emits BlockStored. Run it between steps."""
    hashes = prompt_hashes(engine, token_ids, cache_salt)
    codec = peer_codec(engine)
    verified: list[tuple[int, KVBlock]] = []
    for offset, blob in enumerate(sent.blobs):
        i = sent.start_block + offset
        if i >= len(hashes):
            break
        if engine.pool.contains(hashes[i]):
            continue
        block = codec.decode(blob, hashes[i])
        parent = hashes[i - 1] if i > 0 else None
        if block is None or block.parent != parent or block.dtype != engine.config.dtype:
            break
        verified.append((i, block))
    # Hold the prefix the pool already has while allocating, so the allocation never evicts
    # the blocks the landed ones extend.
    held = _held_prefix(engine, token_ids, hashes)
    engine.pool.touch(held)
    try:
        verified = verified[: max(0, engine.pool.num_free - 1)]
        if not verified:
            return 0
        ids = engine.pool.allocate(len(verified))
        write_blocks(
            engine.runner.kv_caches, ids, [b.array for _, b in verified], engine.config.dtype
        )
        _register(engine, token_ids, ids, verified)
        # Cached and unreferenced, tail first: the request's own prefix match takes them.
        engine.pool.free(list(reversed(ids)))
    finally:
        engine.pool.free(list(reversed(held)))
    return len(verified)


def _held_prefix(
    engine: Engine, token_ids: Sequence[int], hashes: Sequence[BlockHash]
) -> list[BlockId]:
    """The device blocks of the prompt's leading run that the pool holds."""
    bs = engine.config.block_size
    out: list[BlockId] = []
    for i, block_hash in enumerate(hashes):
        block_id = engine.pool.lookup(block_hash, token_ids[i * bs : (i + 1) * bs])
        if block_id is None:
            break
        out.append(block_id)
    return out


def _register(
    engine: Engine,
    token_ids: Sequence[int],
    ids: Sequence[BlockId],
    verified: Sequence[tuple[int, KVBlock]],
) -> None:
    bs = engine.config.block_size
    for block_id, (i, block) in zip(ids, verified, strict=True):
        engine.pool.register(
            block_id, block.block_hash, token_ids[i * bs : (i + 1) * bs], block.parent
        )
