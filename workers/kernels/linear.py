"""Linear layers on CPU over weights packed once into panels (`csrc/packed_linear.cpp`).

`PackedWeights.linear(name, x, weight, bias)` is `F.linear` by the kernel when both are float32 or
bfloat16 on the CPU and the kernel is built (`load()`), else `F.linear` itself. The kernel
needs each weight in its panel layout (`pack`): a `PackedWeights` makes that copy at a weight's
first use and keeps it while the weight (the same tensor, unmodified) is the one passed. The
copy is the weight's size again: the row-major weight stays for `F.linear` when the kernel is
switched off, and for the embedding a tied LM head shares.

On an AVX-512 core a pass over SmolLM2's matmuls at 1-4 rows took 21.4-21.7 ms on one thread
against `F.linear`'s 46.0-65.0, and at 75-1,075 rows 0.69-0.90x `F.linear`'s time on one or two
threads (`python -m cachesvc.bench.step.matmuls`, docs/benchmarks/step.md).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from workers.kernels.build import cpu_capability, load_library
from workers.kernels.host_tensor import HostArena

_SOURCE = Path(__file__).with_name("csrc") / "packed_linear.cpp"
PANEL = 64  # output columns a panel (the kernel's kNB)
_DTYPES = (torch.float32, torch.bfloat16)


def load() -> bool:
    """Whether `torch.ops.cachesvc.packed_linear` is available, building it on first call."""
    return load_library(_SOURCE)


def native_by_default(device: torch.device | str) -> bool:
    """Whether a model on `device` uses the kernel unless told otherwise: on CPUs with AVX-512,
    where it was measured against the library's sgemm (`docs/benchmarks/step.md`)."""
    return torch.device(device).type == "cpu" and cpu_capability() == "AVX512"


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes this call: 2-D x on the CPU, of the weight's dtype, one it has."""
    return (
        x.dim() == 2
        and x.dtype == weight.dtype
        and x.dtype in _DTYPES
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
    )


def pack(weight: torch.Tensor, arena: HostArena | None = None) -> torch.Tensor:
    """The kernel's layout of `weight` `[N, K]`: `[ceil(N / 64), K, 64]`, panel b holding output
    columns [64 b, 64 b + 64) as K rows (the last panel's missing columns are zeros). Written
    into `arena` (huge pages: a decode step streams every panel once) when one is given and the
    weight is on the CPU, else into torch's memory."""
    n, k = weight.shape
    padded = F.pad(weight, (0, 0, 0, (-n) % PANEL))
    panels = padded.view(-1, PANEL, k).transpose(1, 2)
    if arena is not None and weight.device.type == "cpu":
        return arena.copy(panels)
    return panels.contiguous()


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first of equals and the first NaN if any
    (torch's `argmax`, which Hugging Face's greedy search takes), int64 on `values`' device. On
    CPU float32 through NumPy: torch's CPU argmax is a scalar loop, 5-10x slower than NumPy's
    vectorized one over a 49K vocabulary (about 7 ms for 64 rows on an AVX-512 core)."""
    if values.device.type == "cpu" and values.dtype == torch.float32:
        return torch.from_numpy(values.detach().contiguous().numpy().argmax(axis=-1))
    return values.argmax(dim=-1)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, num_outputs: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` by the kernel, from `packed = pack(weight)`; `load()` must
    hold. x `[M, K]`; returns a new `[M, num_outputs]` tensor of x's dtype."""
    out = torch.empty((x.shape[0], num_outputs), dtype=x.dtype)
    torch.ops.cachesvc.packed_linear(x.contiguous(), packed, bias, out)
    return out


def packed_linear_argmax(
    x: torch.Tensor, packed: torch.Tensor, num_outputs: int, argmax_out: torch.Tensor
) -> torch.Tensor:
    """`packed_linear(x, packed, num_outputs)` for float32, no bias, and each output row's
    `row_argmax` written into `argmax_out` (int64 [M]) by the same pass: each tile's largest
    is found while the tile is in cache, not by reading the whole output back."""
    out = torch.empty((x.shape[0], num_outputs), dtype=x.dtype)
    torch.ops.cachesvc.packed_linear_argmax(x.contiguous(), packed, out, argmax_out)
    return out


class PackedWeights:
    """The packed copies of one module's weights, by name, each made at the weight's first use
    and made again when another tensor is passed under that name, or the same one modified in
    place (a loader assigning weights after construction, a test perturbing one). The copies
    lie on huge pages in an arena of their own unless `huge_pages` is False (`pack`); a copy
    made again leaves the old one's space unused until `clear`."""

    def __init__(self, *, huge_pages: bool = True) -> None:
        self._packs: dict[str, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._huge_pages = huge_pages
        self._arena = HostArena() if huge_pages else None

    def of(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """`pack(weight)`, kept for the next call with the same weight."""
        kept = self._packs.get(name)
        if kept is not None and kept[0] is weight and kept[1] == weight._version:
            return kept[2]
        packed = pack(weight.detach(), self._arena)
        self._packs[name] = (weight, weight._version, packed)
        return packed

    def linear(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)`, by the kernel where it takes the call."""
        if fits(x, weight) and load():
            return packed_linear(x, self.of(name, weight), weight.shape[0], bias)
        return F.linear(x, weight, bias)

    def linear_argmax(
        self, name: str, x: torch.Tensor, weight: torch.Tensor, argmax_out: torch.Tensor
    ) -> torch.Tensor:
        """`F.linear(x, weight)`, and each output row's `row_argmax` into `argmax_out` (int64
        [M], on the CPU): in the kernel's pass where it takes the call in float32."""
        if (
            fits(x, weight)
            and x.dtype == torch.float32
            and argmax_out.device.type == "cpu"
            and load()
        ):
            return packed_linear_argmax(x, self.of(name, weight), weight.shape[0], argmax_out)
        out = self.linear(name, x, weight, None)
        argmax_out.copy_(row_argmax(out.float()))
        return out

    def clear(self) -> None:
        """Drop every packed copy (the memory they hold)."""
        self._packs.clear()
        if self._huge_pages:
            self._arena = HostArena()


def linear_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    argmax_out: torch.Tensor,
    *,
    packs: PackedWeights | None,
    name: str,
) -> torch.Tensor:
    """`linear(x, weight, None, ...)`, and each output row's `row_argmax` into `argmax_out`
    (int64 [M], on the output's device): by the kernel's pass over `packs`' copy where it takes
    the call, else from the output."""
    if packs is None:
        out = F.linear(x, weight)
        argmax_out.copy_(row_argmax(out.float()))
        return out
    return packs.linear_argmax(name, x, weight, argmax_out)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    packs: PackedWeights | None,
    name: str,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: by the kernel over `packs`' copy of the weight when `packs`
    is given and the kernel takes the call, else by `F.linear`."""
    if packs is None:
        return F.linear(x, weight, bias)
    return packs.linear(name, x, weight, bias)
