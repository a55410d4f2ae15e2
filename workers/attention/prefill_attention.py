"""The CPU prefill-attention kernel (`csrc/prefill_attention.cpp`): built at first use, then
cached, like the paged-decode kernel. `load()` is False where there is no compiler or the build
fails, and `takes` is False on CPUs without AVX-512; `workers.attention.ops` then keeps ATen's
flash kernel."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.kernels.build import cpu_capability, load_library

_SOURCE = Path(__file__).with_name("csrc") / "prefill_attention.cpp"
_DTYPES = (torch.float32, torch.bfloat16)


def load() -> bool:
    """Whether `torch.ops.cachesvc.prefill_attention` is available, building it on first call."""
    return load_library(_SOURCE)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: CPU with AVX-512 (where it was measured against
    ATen's flash kernel; its portable path is not), one dtype it has, head dims a multiple of
    64, query heads a multiple of KV heads."""
    return (
        q.device.type == "cpu"
        and cpu_capability() == "AVX512"
        and q.dtype in _DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.shape[-1] % 64 == 0
        and q.shape[1] % k.shape[1] == 0
        and load()
    )


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q [Lq, Hq, D]` over `k`, `v [Lk, Hk, D]`, bottom-right causal or not;
    `takes(q, k, v)` must hold. Returns `out [Lq, Hq, D]` in q's dtype and the base-2 LSE
    `[Lq, Hq]` in float32; a query with no visible key gives output 0 and LSE -inf."""
    q, k, v = (t if _heads_contiguous(t) else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], dtype=torch.float32)
    torch.ops.cachesvc.prefill_attention(q, k, v, sm_scale, causal, out, lse)
    return out, lse


def _heads_contiguous(t: torch.Tensor) -> bool:
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]
