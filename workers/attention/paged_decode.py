"""The CPU paged-decode kernel (`csrc/paged_decode.cpp`): built at first use, then cached.

`load()` builds the library that registers `torch.ops.cachesvc.paged_decode` with the
machine's compiler (`workers.kernels.build`); where there is no compiler, or the build fails, it
returns False and the torch backend keeps its gather path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from workers.kernels.build import load_library

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.cpp"


def load() -> bool:
    """Whether `torch.ops.cachesvc.paged_decode` is available, building it on first call."""
    return load_library(_SOURCE)


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    requests: torch.Tensor,
    sm_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention of one query row per request over its pages, in place; `load()` must be True.

    `q [N, Hq, D]`, `kv_cache [pages, 2, page_size, Hk, D]` (same dtype), `kv_indices` int32 (the
    layout's), `requests` int64 `[n, 3]`: each request's query row, the offset of its first page
    in `kv_indices`, and its KV length. Writes those rows of `out [N, Hq, D]` (q's dtype) and of
    the base-2 LSE `lse [N, Hq]` (float32); other rows are left as they are.
    """
    torch.ops.cachesvc.paged_decode(q, kv_cache, kv_indices, requests, sm_scale, out, lse)
