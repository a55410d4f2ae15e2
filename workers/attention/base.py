"""The attention backend interface and its registry.

A backend writes new keys/values into a layer's paged KV cache and computes attention of the new
queries over it, with FlashInfer's semantics (research notes §10): bottom-right causal, GQA,
base-2 LSE, empty rows give output 0 and LSE -inf.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from workers.attention.layout import BatchLayout

if TYPE_CHECKING:
    from workers.attention.custom_mask import CustomMaskLayout
    from workers.attention.multi_item import MultiItemLayout


class AttentionBackend(ABC):
    """Paged attention for one forward pass; stateless apart from what `plan` caches."""

    name: str = "base"

    def plan(self, layout: BatchLayout) -> None:  # noqa: B027 - optional hook
        """Prepare for many `forward` calls (one per layer) on the same layout. Default: nothing."""

    def write_kv(
        self, kv_cache: torch.Tensor, layout: BatchLayout, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store new keys/values `[num_tokens, num_kv_heads, head_dim]` at `layout.write_slots`.

        Mutates `kv_cache` in place. The paged layout is the same for every backend, so one
        index_put writes keys and values together (target view `[num_tokens, 2, Hk, D]`).
        """
        slots = layout.write_slots.to(kv_cache.device)
        pages, offsets = slots // layout.page_size, slots % layout.page_size
        kv_cache[pages, :, offsets] = torch.stack((k, v), dim=1).to(kv_cache.dtype)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        *,
        sm_scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of `q` `[num_tokens, num_qo_heads, head_dim]` over the paged cache.

        Returns the output `[num_tokens, num_qo_heads, head_dim]` in q's dtype and, when
        `return_lse`, the base-2 LSE `[num_tokens, num_qo_heads]` in float32. Reads only.
        """

    def forward_multi_item(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: MultiItemLayout,
        *,
        sm_scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Multi-item scoring attention over a logical batch; default: the torch implementation.

        A backend with its own kernel overrides it. Reads only.
        """
        from workers.attention.multi_item import multi_item_attention

        return multi_item_attention(q, kv_cache, layout, sm_scale=sm_scale, return_lse=return_lse)

    def forward_custom_mask(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CustomMaskLayout,
        *,
        sm_scale: float,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Packed-custom-mask attention; default: the torch implementation. Reads only."""
        from workers.attention.custom_mask import custom_mask_attention

        return custom_mask_attention(q, kv_cache, layout, sm_scale=sm_scale, return_lse=return_lse)


_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {}


def register_backend(name: str, factory: Callable[[], AttentionBackend]) -> None:
    """Make a backend selectable by name."""
    _REGISTRY[name] = factory


def get_backend(name: str) -> AttentionBackend:
    """A fresh backend by name; raises ValueError listing the known names."""
    if name not in _REGISTRY:
        # Importing the module registers the built-in backends.
        import workers.attention.torch_backend  # noqa: F401
    if name == "flashinfer" and name not in _REGISTRY:
        # Imports flashinfer only when a backend is built, which raises without CUDA.
        import workers.attention.flashinfer_backend  # noqa: F401

    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_REGISTRY)}")
    return _REGISTRY[name]()
