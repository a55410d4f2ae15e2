"""Landing fetched blocks in the caches: the host path and the stacked (device) path agree with a
plain per-block, per-layer copy, for every KV dtype and for scattered block ids."""

from __future__ import annotations

import pytest
import torch

from cachesvc.types import BlockId
from workers.engine.kv_copy import kv_to_numpy, read_block, write_host, write_stacked

LAYERS, SHAPE = 3, (2, 4, 2, 8)  # per layer: [K/V, block_size, kv_heads, head_dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["host", "stacked"])
def test_writes_match_a_per_block_copy(dtype: torch.dtype, path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randn((5, LAYERS, *SHAPE), generator=gen).to(dtype)
    arrays = [kv_to_numpy(b.clone()) for b in blocks]
    ids = [BlockId(i) for i in (7, 8, 2, 3, 4)]  # two runs of consecutive ids
    caches = [torch.zeros((10, *SHAPE), dtype=dtype) for _ in range(LAYERS)]
    name = str(dtype).removeprefix("torch.")
    if path == "host":
        write_host(caches, ids, arrays)
    else:
        write_stacked(caches, ids, arrays, name)
    for block, block_id in zip(blocks, ids, strict=True):
        assert torch.equal(torch.stack([c[block_id] for c in caches]), block)
        assert (read_block(caches, block_id) == kv_to_numpy(block)).all()
    untouched = [0, 1, 5, 6, 9]
    assert all(not c[untouched].any() for c in caches)
