"""The exporting side of a pull between workers: a peer encodes a run of a prompt's blocks.

The exporter is given the prompt's token ids and the request's cache salt, not hashes: it
computes the hashes itself under that salt, so a request can only ever be served blocks of its
own tenant (a hash of another tenant's block can not be asked for). It sends the leading run it
holds, from its device pool or its local tiers, each block in the codec's format, encoded (so
copied) between steps (`AsyncEngine.call`): nothing it sends can move or be overwritten while
the transfer runs. The puller's side is `workers.engine.peer.pull`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cachesvc.codec import Codec, KVBlock
from cachesvc.hashing import hash_blocks, root_hash
from cachesvc.types import BlockHash
from workers.engine.kv_copy import read_block
from workers.protocol import PeerBlocks

if TYPE_CHECKING:  # the engine imports this package (its pull side): a type, not a cycle
    from workers.engine.engine import Engine


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
