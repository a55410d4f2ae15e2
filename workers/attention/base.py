"""The attention backend interface: one `forward` for every kind of layout.

A backend writes new keys/values into a layer's paged KV cache and computes attention of the new
queries over it, with FlashInfer's semantics (research notes §10): bottom-right causal, GQA,
base-2 LSE, empty rows give output 0 and LSE -inf.

`forward` dispatches on the layout's type to one protected method per kind: plain paged
(`BatchLayout`), two-level cascade (`CascadeLayout`), multi-item scoring (`MultiItemLayout`) and
packed custom masks (`CustomMaskLayout`); a step's `SchemeLayout` (schemes.py) is unwrapped to the
one its scheme attends with. Only plain paged attention is abstract. Cascade runs as two plain
passes merged by LSE, and the logical kinds default to the torch implementations, so a backend
overrides only the kinds it has kernels for. The registry of backends is the package's
(`workers.attention.get_backend`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol, final

import torch

from workers.attention.cascade import CascadeLayout, merge_shared_level
from workers.attention.custom_mask import CustomMaskLayout, custom_mask_attention
from workers.attention.layout import BatchLayout
from workers.attention.multi_item import MultiItemLayout, multi_item_attention
from workers.kernels.fused import load as load_fused

# The output `[num_tokens, num_qo_heads, head_dim]`, and with `return_lse` the base-2 LSE.
Attention = torch.Tensor | tuple[torch.Tensor, torch.Tensor]

# The layouts a backend computes attention over, one per kind.
KernelLayout = BatchLayout | CascadeLayout | MultiItemLayout | CustomMaskLayout
_KERNEL_LAYOUTS = (BatchLayout, CascadeLayout, MultiItemLayout, CustomMaskLayout)


class StepLayout(Protocol):
    """A whole step's layout (`schemes.SchemeLayout`): where new K/V go, and what attention reads.

    A protocol, so that the interface needs no import of the schemes built on it.
    """

    @property
    def batch(self) -> BatchLayout: ...

    @property
    def attention(self) -> KernelLayout: ...


AttentionLayout = KernelLayout | StepLayout


def kernel_layout(layout: AttentionLayout) -> KernelLayout:
    """The layout attention reads: `layout` itself, or the one a step's layout carries."""
    return layout if isinstance(layout, _KERNEL_LAYOUTS) else layout.attention


def with_lse(result: Attention) -> tuple[torch.Tensor, torch.Tensor]:
    """The `(out, lse)` pair of a `forward(..., return_lse=True)`, typed as such."""
    assert isinstance(result, tuple), "forward was called without return_lse"
    return result


def _native_write(
    kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> bool:
    """Whether the CPU kernel writes these keys and values: a contiguous CPU cache of their
    dtype, int64 slots, heads contiguous within each token's row."""
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.is_contiguous()
        and slots.dtype == torch.int64
        and slots.is_contiguous()
        and all(
            t.dtype == kv_cache.dtype and t.stride(2) == 1 and t.stride(1) == t.shape[2]
            for t in (k, v)
        )
        and load_fused()
    )


class AttentionBackend(ABC):
    """Paged attention for one forward pass; stateless apart from what `plan` caches."""

    name: str = "base"

    def plan(self, layout: AttentionLayout) -> None:  # noqa: B027 - optional hook
        """Prepare for many `forward` calls (one per layer) on the same layout. Default: nothing."""

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        layout: BatchLayout | StepLayout,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store new keys/values `[num_tokens, num_kv_heads, head_dim]` at the write slots.

        Mutates `kv_cache` in place. The paged layout is the same for every backend, so one
        index_put writes keys and values together (target view `[num_tokens, 2, Hk, D]`).
        """
        batch = layout if isinstance(layout, BatchLayout) else layout.batch
        slots = batch.write_slots.to(kv_cache.device)
        if _native_write(kv_cache, slots, k, v):
            # One call where the indexing below is five (`csrc/fused_ops.cpp`).
            torch.ops.cachesvc.write_kv(kv_cache, slots, k, v)
            return
        pages, offsets = slots // batch.page_size, slots % batch.page_size
        kv_cache[pages, :, offsets] = torch.stack((k, v), dim=1).to(kv_cache.dtype)

    @final
    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: AttentionLayout,
        *,
        sm_scale: float,
        return_lse: bool = False,
    ) -> Attention:
        """Attention of `q` `[num_tokens, num_qo_heads, head_dim]` over the paged cache.

        Returns the output `[num_tokens, num_qo_heads, head_dim]` in q's dtype and, when
        `return_lse`, the base-2 LSE `[num_tokens, num_qo_heads]` in float32. Reads only.
        """
        kind = kernel_layout(layout)
        if isinstance(kind, BatchLayout):
            return self._forward_paged(q, kv_cache, kind, sm_scale=sm_scale, return_lse=return_lse)
        if isinstance(kind, CascadeLayout):
            return self._forward_cascade(
                q, kv_cache, kind, sm_scale=sm_scale, return_lse=return_lse
            )
        if isinstance(kind, MultiItemLayout):
            return self._forward_multi_item(
                q, kv_cache, kind, sm_scale=sm_scale, return_lse=return_lse
            )
        return self._forward_custom_mask(
            q, kv_cache, kind, sm_scale=sm_scale, return_lse=return_lse
        )

    @abstractmethod
    def _forward_paged(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        """Plain paged attention over the request pages of `layout`; contract of `forward`."""

    def _forward_cascade(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CascadeLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        """Cascade: each level as plain paged attention, then merged by base-2 LSE.

        The unique level runs on this backend, the shared level on `_shared_level()`.
        """
        result = self.forward(q, kv_cache, layout.unique, sm_scale=sm_scale, return_lse=True)
        out, lse = with_lse(result)
        if layout.shared is not None:
            q_shared = layout.shared_queries(q)
            shared = self._shared_level().forward(
                q_shared, kv_cache, layout.shared, sm_scale=sm_scale, return_lse=True
            )
            merge_shared_level(layout, out, lse, *with_lse(shared))
        return (out, lse) if return_lse else out

    def _shared_level(self) -> AttentionBackend:
        """The backend that runs cascade's shared level: this one unless a subclass keeps a
        second instance, so that each level's plan stays cached across layers (as FlashInfer
        keeps one wrapper per level). With one instance each level plans afresh at every call.
        """
        return self

    def _forward_multi_item(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: MultiItemLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        """Multi-item scoring over a logical batch; default: the torch implementation."""
        return multi_item_attention(q, kv_cache, layout, sm_scale=sm_scale, return_lse=return_lse)

    def _forward_custom_mask(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: CustomMaskLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        """Packed-custom-mask attention; default: the torch implementation."""
        return custom_mask_attention(q, kv_cache, layout, sm_scale=sm_scale, return_lse=return_lse)
