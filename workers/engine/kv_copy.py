"""Block KV between the device caches (one `[num_blocks, ...]` tensor per layer) and the codec's
numpy storage arrays (`[layers, ...]` per block): what a demotion reads and a fetch writes, and
a fetch's blocks registered in the pool (`write_registered`).

A layer's slice of a block is small (24 KB for SmolLM2 in float32), so the cost of a fetch is in
how many copy calls land it. The engine allocates the layers as slices of one
`[layers, num_blocks, ...]` tensor (`LlamaModel.allocate_kv_cache`), so a block across all layers
is one strided copy: one numpy assignment per block on the host, one transfer per run of
consecutive blocks on a device. Separately allocated caches still work, a copy per layer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.codec import KVBlock
from cachesvc.kv.types import BlockHash, BlockId


def kv_to_numpy(data: torch.Tensor) -> np.ndarray:
    """A tensor as the codec's numpy storage array (numpy has no bfloat16: its bits as uint16).

    A view for a host tensor: writing the array writes the tensor."""
    data = data.cpu()
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(np.uint16)
    return data.numpy()


def layered(kv_caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The `[layers, num_blocks, ...]` view of caches that are evenly spaced slices of one
    storage (as `allocate_kv_cache` makes them), else None."""
    first = kv_caches[0]
    if len(kv_caches) < 2:
        return first.unsqueeze(0)
    ptr = first.untyped_storage().data_ptr()
    step = kv_caches[1].data_ptr() - first.data_ptr()
    if step <= 0 or step % first.element_size() or not first.is_contiguous():
        return None
    for layer, cache in enumerate(kv_caches):
        same_storage = cache.untyped_storage().data_ptr() == ptr
        if not same_storage or cache.data_ptr() != first.data_ptr() + layer * step:
            return None
        if cache.shape != first.shape or cache.stride() != first.stride():
            return None
    shape = (len(kv_caches), *first.shape)
    return first.as_strided(shape, (step // first.element_size(), *first.stride()))


def read_block(
    kv_caches: Sequence[torch.Tensor], block_id: BlockId, whole: torch.Tensor | None = None
) -> np.ndarray:
    """A copy of one block's KV across the layers; `whole` is `layered(kv_caches)` when the
    caller keeps it (it checks every layer: worth computing once, not once per block)."""
    whole = whole if whole is not None else layered(kv_caches)
    if whole is not None:
        return kv_to_numpy(whole[:, block_id].clone(memory_format=torch.contiguous_format))
    return kv_to_numpy(torch.stack([cache[block_id] for cache in kv_caches]))


def gather_blocks(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[BlockId], out: torch.Tensor
) -> None:
    """Copy blocks `block_ids` across the layers into `out` (a host tensor `[len(block_ids),
    layers, ...]`), in one batched gather (one per layer for separate caches): what a holder
    stages for a pull. `out` is best a reused buffer: fresh host memory costs its page faults,
    which on a CPU are most of the copy. On a device the gather runs there, then one copy."""
    index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_caches[0].device)
    whole = layered(kv_caches)
    if whole is not None and kv_caches[0].is_cpu:
        torch.index_select(whole.transpose(0, 1), 0, index, out=out)
    elif whole is not None:
        out.copy_(torch.index_select(whole.transpose(0, 1), 0, index))
    else:
        for layer, cache in enumerate(kv_caches):
            out[:, layer].copy_(torch.index_select(cache, 0, index))


def copy_blocks(kv_caches: Sequence[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the KV of blocks `src` into blocks `dst` (index tensors) in every layer."""
    whole = layered(kv_caches)
    if whole is not None:
        whole[:, dst] = whole[:, src]
        return
    for cache in kv_caches:
        cache[dst] = cache[src]


def write_blocks(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[BlockId],
    arrays: Sequence[np.ndarray],
    dtype: str,
) -> None:
    """Copy blocks (storage arrays of `dtype`'s storage dtype) into `block_ids` of the caches."""
    if kv_caches[0].is_cpu:
        write_host(kv_caches, block_ids, arrays)
    else:
        write_stacked(kv_caches, block_ids, arrays, dtype)


def write_registered(
    kv_caches: Sequence[torch.Tensor],
    pool: BlockPool,
    block_ids: Sequence[BlockId],
    blocks: Sequence[KVBlock],
    indexes: Sequence[int],
    token_ids: Sequence[int],
    hashes: Sequence[BlockHash],
    block_size: int,
    dtype: str,
) -> float:
    """Write fetched `blocks` (blocks `indexes` of a prompt of `token_ids`, whose full blocks
    are `hashes`) into `block_ids`, mark the lossy ones (`BlockPool.mark_lossy`: a block whose
    hash another holds stays the writer's own, marked all the same) and register each under its
    hash. Returns the seconds the copy into the caches took (registering is not counted).
    Between steps."""
    start = time.perf_counter()
    write_blocks(kv_caches, block_ids, [b.array for b in blocks], dtype)
    copy_s = time.perf_counter() - start
    pool.mark_lossy(i for i, b in zip(block_ids, blocks, strict=True) if b.lossy)
    bs = block_size
    for block_id, block, idx in zip(block_ids, blocks, indexes, strict=True):
        parent = hashes[idx - 1] if idx > 0 else None
        pool.register(block_id, block.block_hash, token_ids[idx * bs : (idx + 1) * bs], parent)
    return copy_s


def write_host(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[BlockId], arrays: Sequence[np.ndarray]
) -> None:
    """Host caches: numpy assignments, block by block (the source is read in order). A numpy
    assignment costs a fraction of a torch `copy_` call, which matters at one call per block
    (or per layer and block, for separate caches)."""
    whole = layered(kv_caches)
    if whole is not None:
        dest = kv_to_numpy(whole)  # a view: writing it writes the caches
        for block_id, array in zip(block_ids, arrays, strict=True):
            dest[:, block_id] = array
        return
    dests = [kv_to_numpy(cache) for cache in kv_caches]
    for block_id, array in zip(block_ids, arrays, strict=True):
        for layer, layer_dest in enumerate(dests):
            layer_dest[block_id] = array[layer]


def write_stacked(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[BlockId],
    arrays: Sequence[np.ndarray],
    dtype: str,
) -> None:
    """Device caches: one transfer per run of consecutive block ids (and per layer, for
    separate caches): a transfer per block and layer would pay a launch for every slice."""
    whole = layered(kv_caches)
    for lo, hi in _runs(block_ids):
        first = block_ids[lo]
        staged = torch.stack([_as_tensor(array, dtype) for array in arrays[lo:hi]], dim=1)
        if whole is not None:
            whole[:, first : first + hi - lo].copy_(staged)
            continue
        for layer, cache in enumerate(kv_caches):
            cache[first : first + hi - lo].copy_(staged[layer])


def _as_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A storage array as a tensor, sharing its memory (bfloat16 travels as its uint16 bits)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.int16).view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _runs(block_ids: Sequence[BlockId]) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of `block_ids` whose ids are consecutive."""
    bounds = [i for i in range(1, len(block_ids)) if block_ids[i] != block_ids[i - 1] + 1]
    edges = [0, *bounds, len(block_ids)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:], strict=False) if hi > lo]
