"""Block KV between the device caches (one `[num_blocks, ...]` tensor per layer) and the codec's
numpy storage arrays (`[layers, ...]` per block): what a demotion reads and a fetch writes.

A layer's slice of a block is small (24 KB for SmolLM2 in float32), so the cost of a fetch is in
how many copy calls land it: host caches take a numpy assignment per slice, in source order;
device caches take one stacked transfer per layer and run of consecutive blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from cachesvc.types import BlockId


def kv_to_numpy(data: torch.Tensor) -> np.ndarray:
    """A tensor as the codec's numpy storage array (numpy has no bfloat16: its bits as uint16).

    A view for a host tensor: writing the array writes the tensor."""
    data = data.cpu()
    if data.dtype == torch.bfloat16:
        return data.view(torch.int16).numpy().view(np.uint16)
    return data.numpy()


def read_block(kv_caches: Sequence[torch.Tensor], block_id: BlockId) -> np.ndarray:
    """A copy of one block's KV across the layers."""
    return kv_to_numpy(torch.stack([cache[block_id] for cache in kv_caches]))


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


def write_host(
    kv_caches: Sequence[torch.Tensor], block_ids: Sequence[BlockId], arrays: Sequence[np.ndarray]
) -> None:
    """Host caches: a numpy assignment per layer slice, block by block (the source is read in
    order). A numpy assignment costs a fraction of a torch `copy_` call, which matters at one
    call per layer and block: measured on SmolLM2, a 4K prefix lands ~1.5x faster this way."""
    dests = [kv_to_numpy(cache) for cache in kv_caches]  # views: writing them writes the caches
    for block_id, array in zip(block_ids, arrays, strict=True):
        for layer, dest in enumerate(dests):
            dest[block_id] = array[layer]


def write_stacked(
    kv_caches: Sequence[torch.Tensor],
    block_ids: Sequence[BlockId],
    arrays: Sequence[np.ndarray],
    dtype: str,
) -> None:
    """Device caches: one transfer per layer and run of consecutive block ids (a transfer per
    block and layer would pay a launch for every slice)."""
    layers = [_as_tensor(array, dtype).unbind(0) for array in arrays]
    for lo, hi in _runs(block_ids):
        first = block_ids[lo]
        for layer, cache in enumerate(kv_caches):
            staged = torch.stack([per_block[layer] for per_block in layers[lo:hi]])
            cache[first : first + hi - lo].copy_(staged)


def _as_tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A storage array as a tensor, sharing its memory (bfloat16 travels as its uint16 bits)."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.int16).view(torch.bfloat16) if dtype == "bfloat16" else tensor


def _runs(block_ids: Sequence[BlockId]) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of `block_ids` whose ids are consecutive."""
    bounds = [i for i in range(1, len(block_ids)) if block_ids[i] != block_ids[i - 1] + 1]
    edges = [0, *bounds, len(block_ids)]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:], strict=False) if hi > lo]
