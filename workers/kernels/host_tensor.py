"""Host tensors on transparent huge pages, for the big buffers a step streams or scatters over.

torch's CPU allocator asks for no huge pages. Two kinds of buffer are read in full or in
scattered slices every step: the KV cache (pages anywhere in the pool) and the packed weights
(540 MB a decode step for SmolLM2, each read once). On 4 KB pages every 4 KB is a TLB miss and
the hardware prefetcher stops at each page's edge; on 2 MB pages neither happens. Measured
here, a fetched block landed in the KV cache ~25% faster (`cachesvc.kv.host_memory`), and the
decode pass over the packed weights streamed faster (docs/benchmarks/step.md).

The kernel backs only whole, aligned 2 MB spans with huge pages, and aligns a mapping only when
it is large: a 2.2 MB weight in a mapping of its own got almost none (12 of 110 MB in a probe).
So small tensors share large mappings (`HostArena`).
"""

from __future__ import annotations

import math

import torch

from cachesvc.kv.host_memory import host_buffer

_HUGE = 2 << 20  # bytes of a transparent huge page on x86-64 and arm64's default
_ALIGN = 64  # a cache line: every tensor an arena hands out starts on one


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed, contiguous CPU tensor of `shape` in a mapping of its own on transparent huge
    pages, faulted in now. Falls back to 4 KB pages where the kernel offers no huge pages."""
    raw = torch.from_numpy(host_buffer(_nbytes(shape, dtype), populate="now"))
    return raw.view(dtype).view(shape)


class HostArena:
    """Hands out contiguous CPU tensors from shared mappings of at least `chunk_bytes` on huge
    pages; memory is faulted in as tensors are written, so an arena costs what it holds (rounded
    up to 2 MB). A tensor keeps its mapping alive; nothing is ever handed back to the arena."""

    def __init__(self, chunk_bytes: int = 64 << 20) -> None:
        self._chunk_bytes = _round_up(chunk_bytes, _HUGE)
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype` (zeros if never written)."""
        nbytes = _nbytes(shape, dtype)
        if self._chunk is None or self._used + nbytes > self._chunk.numel():
            size = max(self._chunk_bytes, _round_up(nbytes, _HUGE))
            self._chunk = torch.from_numpy(host_buffer(size, populate="lazy"))
            self._used = 0
        start = self._used
        self._used = _round_up(start + nbytes, _ALIGN)
        return self._chunk[start : start + nbytes].view(dtype).view(shape)

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU `tensor` in the arena."""
        out = self.empty(tuple(tensor.shape), tensor.dtype)
        out.copy_(tensor)
        return out
