"""FlashInfer's FA2 kernels behind the `AttentionBackend` interface (CUDA only).

Same semantics as the torch backend (research notes §10): the paged prefill wrapper for plain
and cascade-level attention, the decode wrapper when every request has one new token. A logical
batch (multi-item scoring with `prefix_len_ptr` / `token_pos_in_items_ptr` / `max_item_len_ptr`,
or packed custom masks) is not a valid paged sequence, so its K/V are gathered from its slots
into a cache of one-token pages, which the paged prefill wrapper reads. (Not the ragged wrapper:
its `run()` in 0.7.2.post1 never selects the multi-item mask mode, so it would silently attend
causally; the paged `run()` does.) Every wrapper is pinned to `backend="fa2"`, so one compiled
prefill module per dtype and head dim serves all schemes (and custom masks, which FA3 lacks).

flashinfer is imported only when a backend is built: importing this module works on any machine,
and `FlashInferBackend()` raises a RuntimeError saying what is missing, or which version it found
when it is not `FLASHINFER_VERSION`, the one whose wrappers this module was checked against: it
writes and clears private wrapper attributes (`_mask_indptr_buf`, ...) whose meaning is that
version's, and checks at each plan that they exist.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workers.attention.base import Attention, AttentionBackend, AttentionLayout
from workers.attention.custom_mask import CustomMaskLayout
from workers.attention.layout import BatchLayout
from workers.attention.multi_item import LogicalBatch, MultiItemLayout

FLASHINFER_VERSION = "0.7.2.post1"  # pinned alike in pyproject's gpu extra and the CUDA image
WORKSPACE_BYTES = 128 << 20
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MISSING = "FlashInfer backend needs CUDA and flashinfer-python (pip install '.[gpu]')"

# What the paged prefill wrapper's run() reads to pick its mask mode (prefill.py at
# FLASHINFER_VERSION): custom while `_custom_mask_buf` is set, multi-item scoring while
# `_prefix_len_ptr` is, from whichever plan() set them. Versions differ in whether plan() resets
# them, so after each plan the backend clears those of the other mask kinds itself.
_CUSTOM_MASK_ATTRS = ("_custom_mask_buf", "_mask_indptr_buf")
_MULTI_ITEM_ATTRS = ("_prefix_len_ptr", "_token_pos_in_items_ptr", "_max_item_len_ptr")
_STALE_AFTER_PLAN = {
    "plain": _CUSTOM_MASK_ATTRS + _MULTI_ITEM_ATTRS,
    "multi_item": _CUSTOM_MASK_ATTRS,
    "custom_mask": _MULTI_ITEM_ATTRS,
}

# One float workspace per device, shared by every wrapper: a wrapper keeps its plan in its own
# int workspace and uses the float one only inside `run` (split-KV partial results), and runs on
# one stream never overlap.
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def load_flashinfer() -> Any:
    """The flashinfer module; RuntimeError without CUDA, without the package, or when its
    version is not `FLASHINFER_VERSION`."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{MISSING}: no CUDA device is visible")
    try:
        import flashinfer
    except ImportError as err:
        raise RuntimeError(f"{MISSING}: {err}") from err
    installed = _version(flashinfer)
    # A local build tag (`0.7.2.post1+cu130`) names the same release.
    if installed.split("+")[0] != FLASHINFER_VERSION:
        raise RuntimeError(
            f"FlashInfer backend needs flashinfer-python=={FLASHINFER_VERSION}, the version its "
            f"mask and plan handling was checked against, but {installed} is installed: "
            f"pip install 'flashinfer-python=={FLASHINFER_VERSION}' (or '.[gpu]')"
        )
    return flashinfer


def _version(flashinfer: Any) -> str:
    return str(getattr(flashinfer, "__version__", "unknown"))


def _workspace(device: torch.device) -> torch.Tensor:
    if device not in _WORKSPACES:
        # Zeroed: FlashInfer requires a zero-initialized buffer for its first use.
        _WORKSPACES[device] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[device]


@dataclass(frozen=True)
class _PlanKey:
    """What FlashInfer's `plan()` takes beyond the layout; a change needs a new plan."""

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float

    @classmethod
    def of(cls, q: torch.Tensor, kv_cache: torch.Tensor, sm_scale: float) -> _PlanKey:
        """The key of these inputs; ValueError for dtypes the FA2 kernels lack (float32)."""
        if q.dtype not in KERNEL_DTYPES or kv_cache.dtype not in KERNEL_DTYPES:
            raise ValueError(
                f"FlashInfer's FA2 kernels take float16 or bfloat16, got q {q.dtype} and KV "
                f"cache {kv_cache.dtype}: run the model in bfloat16 or use the torch backend"
            )
        return cls(q.dtype, kv_cache.dtype, q.shape[1], kv_cache.shape[3], q.shape[2], sm_scale)

    def plan_kwargs(self) -> dict[str, Any]:
        return {
            "sm_scale": self.sm_scale,
            "q_data_type": self.q_dtype,
            "kv_data_type": self.kv_dtype,
        }


@dataclass(frozen=True)
class _OneTokenPages:
    """A logical batch's keys and values copied out of the paged cache, one token per page."""

    pages: torch.Tensor  # int64 [nnz_kv]: page and in-page offset of each logical key
    offsets: torch.Tensor

    @classmethod
    def of(cls, logical: LogicalBatch, page_size: int, device: torch.device) -> _OneTokenPages:
        slots = logical.kv_slots.to(device)
        return cls(slots // page_size, slots % page_size)

    def read(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """A contiguous NHD cache `[nnz_kv, 2, 1, Hk, D]`: page i holds logical key i."""
        return kv_cache[self.pages, :, self.offsets].unsqueeze(2)


@dataclass(frozen=True)
class _Planned:
    """The layout a wrapper is planned for (by identity), and how to run it."""

    layout: object
    key: _PlanKey
    wrapper: Any
    gather: _OneTokenPages | None = None  # logical layouts only


class FlashInferBackend(AttentionBackend):
    """Paged attention with FlashInfer's FA2 kernels; one plan per layout, reused by all layers.

    `plan(layout)` drops the previous plan; FlashInfer's own `plan()` runs at the first forward
    of a layout, because it also takes the head counts, head dim, dtypes and `sm_scale` that come
    with q and the cache. Each instance keeps one plan at a time (like one FlashInfer wrapper), so
    cascade levels take one instance each (`make_scheme_backend` builds two).
    `decode_tensor_cores` runs decode batches on the prefill (tensor-core) kernel instead of the
    CUDA-core decode kernel. One paged prefill wrapper serves plain, multi-item and custom-mask
    plans in turn; each plan clears what an earlier one of another kind left on it. Raises
    RuntimeError without CUDA or flashinfer, or with another flashinfer version.
    """

    name = "flashinfer"

    def __init__(self, *, decode_tensor_cores: bool = False) -> None:
        self._fi = load_flashinfer()
        self.decode_tensor_cores = decode_tensor_cores
        self._wrappers: dict[str, Any] = {}
        self._planned: _Planned | None = None

    def _wrapper(self, kind: str, device: torch.device) -> Any:
        """The wrapper of `kind` ("paged" or "decode") on `device`, built on first use."""
        key = f"{kind}@{device}"
        if key not in self._wrappers:
            fi, ws = self._fi, _workspace(device)
            if kind == "paged":
                wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
            else:
                wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=self.decode_tensor_cores, backend="fa2"
                )
            self._wrappers[key] = wrapper
        return self._wrappers[key]

    def _after_plan(self, wrapper: Any, kind: str) -> None:
        """After a prefill wrapper's plan() for `kind` ("plain", "multi_item", "custom_mask"):
        raise RuntimeError unless the attributes its run() reads exist, then clear those of the
        other mask kinds, so that no earlier plan's mask outlives it."""
        names = _CUSTOM_MASK_ATTRS + _MULTI_ITEM_ATTRS
        if missing := [name for name in names if not hasattr(wrapper, name)]:
            raise RuntimeError(
                f"flashinfer {_version(self._fi)}: BatchPrefillWithPagedKVCacheWrapper has no "
                f"{', '.join(missing)} after plan(); the FlashInfer backend sets and clears them "
                f"as flashinfer-python {FLASHINFER_VERSION} defines them"
            )
        for name in _STALE_AFTER_PLAN[kind]:
            setattr(wrapper, name, None)

    def _current(self, layout: object, key: _PlanKey) -> _Planned | None:
        # Identity, not equality: a layout holds tensors, and each step builds a fresh one.
        planned = self._planned
        if planned is not None and planned.layout is layout and planned.key == key:
            return planned
        return None

    # ---- plain paged attention ---------------------------------------------------------------

    def plan(self, layout: AttentionLayout) -> None:
        self._planned = None

    def _plan_paged(self, layout: BatchLayout, key: _PlanKey, device: torch.device) -> _Planned:
        if all(n == 1 for n in layout.qo_lens):
            # One query per request sees its whole KV, causal or not: the decode kernel's case.
            wrapper = self._wrapper("decode", device)
            wrapper.plan(
                layout.kv_indptr,
                layout.kv_indices,
                layout.kv_last_page_len,
                key.num_qo_heads,
                key.num_kv_heads,
                key.head_dim,
                layout.page_size,
                **key.plan_kwargs(),
            )
        else:
            wrapper = self._wrapper("paged", device)
            wrapper.plan(
                layout.qo_indptr,
                layout.kv_indptr,
                layout.kv_indices,
                layout.kv_last_page_len,
                key.num_qo_heads,
                key.num_kv_heads,
                key.head_dim,
                layout.page_size,
                causal=layout.causal,
                **key.plan_kwargs(),
            )
            self._after_plan(wrapper, "plain")
        return _Planned(layout, key, wrapper)

    def _forward_paged(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        key = _PlanKey.of(q, kv_cache, sm_scale)
        planned = self._current(layout, key) or self._plan_paged(layout, key, q.device)
        self._planned = planned
        result: Attention = planned.wrapper.run(q.contiguous(), kv_cache, return_lse=return_lse)
        return result

    # ---- logical batches: multi-item scoring and custom masks ----------------------------------

    def _plan_logical(
        self, layout: MultiItemLayout | CustomMaskLayout, key: _PlanKey, kv_cache: torch.Tensor
    ) -> _Planned:
        device = kv_cache.device
        logical = layout.logical
        wrapper = self._wrapper("paged", device)
        one_token_pages = (
            logical.qo_indptr,
            logical.kv_indptr,  # key offsets are page offsets when a page holds one key
            torch.arange(sum(logical.kv_lens), dtype=torch.int32, device=device),
            torch.ones(logical.num_requests, dtype=torch.int32, device=device),
            key.num_qo_heads,
            key.num_kv_heads,
            key.head_dim,
            1,
        )
        if isinstance(layout, MultiItemLayout):
            # The kernel reads these three on the device; it applies the causal rule itself.
            wrapper.plan(
                *one_token_pages,
                causal=True,
                prefix_len_ptr=layout.prefix_len_ptr.to(device),
                token_pos_in_items_ptr=layout.token_pos_in_items_ptr.to(device),
                token_pos_in_items_len=layout.token_pos_in_items_len,
                max_item_len_ptr=layout.max_item_len_ptr.to(device),
                **key.plan_kwargs(),
            )
            self._after_plan(wrapper, "multi_item")
        else:
            mask = layout.packed_mask.to(device)
            wrapper.plan(*one_token_pages, packed_custom_mask=mask, **key.plan_kwargs())
            self._after_plan(wrapper, "custom_mask")
            # With only `packed_custom_mask`, plan() keeps mask_indptr in bits (qo_len * kv_len
            # per request) while the kernel offsets the packed bytes by it (flashinfer PR #2201):
            # right for one request, wrong for more. Ours is in bytes, as the kernel reads it.
            wrapper._mask_indptr_buf = layout.mask_indptr.to(device=device, dtype=torch.int32)
        gather = _OneTokenPages.of(logical, kv_cache.shape[2], device)
        return _Planned(layout, key, wrapper, gather)

    def _forward_logical(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: MultiItemLayout | CustomMaskLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        """Attention over a logical batch, its K/V gathered into one-token pages per call."""
        key = _PlanKey.of(q, kv_cache, sm_scale)
        planned = self._current(layout, key) or self._plan_logical(layout, key, kv_cache)
        self._planned = planned
        assert planned.gather is not None
        pages = planned.gather.read(kv_cache)
        result: Attention = planned.wrapper.run(q.contiguous(), pages, return_lse=return_lse)
        return result

    # Both logical kinds are the paged wrapper over one-token pages; `_plan_logical` picks the
    # mask mode from the layout's type.
    _forward_multi_item = _forward_custom_mask = _forward_logical
