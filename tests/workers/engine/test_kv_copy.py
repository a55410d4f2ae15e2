"""Landing fetched blocks in the caches: the host path and the stacked (device) path agree with a
plain per-block, per-layer copy, for every KV dtype, for scattered block ids, and for both cache
layouts (slices of one `[layers, blocks, ...]` tensor, and separate tensors per layer)."""

from __future__ import annotations

import pytest
import torch

from cachesvc.kv.types import BlockId
from workers.engine.kv_copy import (
    copy_blocks,
    kv_to_numpy,
    layered,
    read_block,
    write_host,
    write_stacked,
)

LAYERS, SHAPE = 3, (2, 4, 2, 8)  # per layer: [K/V, block_size, kv_heads, head_dim]


def _caches(layout: str, dtype: torch.dtype, num_blocks: int = 10) -> list[torch.Tensor]:
    if layout == "one":
        return list(torch.zeros((LAYERS, num_blocks, *SHAPE), dtype=dtype).unbind(0))
    return [torch.zeros((num_blocks, *SHAPE), dtype=dtype) for _ in range(LAYERS)]


@pytest.mark.parametrize("layout", ["one", "separate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["host", "stacked"])
def test_writes_match_a_per_block_copy(layout: str, dtype: torch.dtype, path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn((5, LAYERS, *SHAPE), generator=gen).to(dtype)
    arrays = [kv_to_numpy(b.clone()) for b in blocks]
    ids = [BlockId(i) for i in (7, 8, 2, 3, 4)]  # two runs of consecutive ids
    caches = _caches(layout, dtype)
    assert (layered(caches) is not None) == (layout == "one")
    name = str(dtype).removeprefix("torch.")
    if path == "host":
        write_host(caches, ids, arrays)
    else:
        write_stacked(caches, ids, arrays, name)
    for block, block_id in zip(blocks, ids, strict=True):
        assert torch.equal(torch.stack([c[block_id] for c in caches]), block)
        read = read_block(caches, block_id)
        assert (read == kv_to_numpy(block)).all()
        read[...] = 0  # a copy, not a view of the caches
        assert torch.equal(torch.stack([c[block_id] for c in caches]), block)
    untouched = [0, 1, 5, 6, 9]
    assert all(not c[untouched].any() for c in caches)


@pytest.mark.parametrize("layout", ["one", "separate"])
def test_copy_blocks_copies_every_layer(layout: str) -> None:
    caches = _caches(layout, torch.float32, num_blocks=6)
    for layer, cache in enumerate(caches):
        cache.copy_(torch.randn(cache.shape) + layer)
    before = [c.clone() for c in caches]
    copy_blocks(caches, torch.tensor([1, 4]), torch.tensor([5, 0]))
    for cache, old in zip(caches, before, strict=True):
        assert torch.equal(cache[5], old[1]) and torch.equal(cache[0], old[4])
        assert torch.equal(cache[1:5], old[1:5])


def test_layered_refuses_caches_that_are_not_evenly_spaced() -> None:
    whole = torch.zeros((4, 6, *SHAPE))
    assert layered([whole[0], whole[1], whole[3]]) is None
    assert layered([whole[1], whole[0]]) is None
    assert layered(list(whole.unbind(0))) is not None
