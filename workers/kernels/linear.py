"""Linear layers at decode's row counts, on CPU: the small-M kernel (`csrc/small_linear.cpp`).

`linear(x, weight, bias, native=True)` is `F.linear` with the weights streamed once for all of
x's rows when x has at most `MAX_ROWS` rows, both are float32 or bfloat16 on the CPU and the
kernel is built (`load()`); otherwise, and for prefill's many rows, it is `F.linear` itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from workers.kernels.build import cpu_capability, load_library

_SOURCE = Path(__file__).with_name("csrc") / "small_linear.cpp"
# Past 16 rows the kernel's L1 re-reads of a weight block cost what sgemm's packing saves.
MAX_ROWS = 16
_DTYPES = (torch.float32, torch.bfloat16)


def load() -> bool:
    """Whether `torch.ops.cachesvc.small_linear` is available, building it on first call."""
    return load_library(_SOURCE)


def native_by_default(device: torch.device | str) -> bool:
    """Whether a model on `device` uses the kernel unless told otherwise: on CPUs with AVX-512,
    where it was measured against the library's sgemm (`docs/benchmarks/step.md`)."""
    return torch.device(device).type == "cpu" and cpu_capability() == "AVX512"


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this call: few rows of 2-D x, CPU, one dtype of the two."""
    return (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
        and x.device.type == "cpu"
    )


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel; `fits` and `load()` must hold. x `[M, K]`,
    weight `[N, K]`, bias `[N]`; returns a new `[M, N]` tensor of their dtype."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
    torch.ops.cachesvc.small_linear(x.contiguous(), weight.contiguous(), bias, out)
    return out


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, native: bool
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, by the kernel when `native` and it takes the call."""
    if native and fits(x, weight) and load():
        return small_linear(x, weight, bias)
    return F.linear(x, weight, bias)
