"""A CPU stand-in for `flashinfer` 0.7.2.post1, written from FlashInfer's documentation.

Nothing here comes from this repository's attention code: every rule below is FlashInfer's own
statement of it, so a test comparing the FlashInfer backend over this fake with a dense reference
catches a backend that feeds FlashInfer inputs meaning something else under FlashInfer's rules.

* Paged KV ("KV-Cache Layout" tutorial, page table): request b owns the pages
  `paged_kv_indices[paged_kv_indptr[b]:paged_kv_indptr[b+1]]` of an NHD cache
  `[num_pages, 2, page_size, num_kv_heads, head_dim]` (`[:, 0]` keys, `[:, 1]` values), and its
  KV length is `page_size * (num_pages - 1) + last_page_len[b]`. Index arrays are int32.
* Causal: bottom-right aligned. The docstring example of `single_prefill_with_kv_cache` builds the
  mask equal to `causal=True` as `torch.tril(ones(qo_len, kv_len), diagonal=kv_len - qo_len)`:
  query i sees key j iff `j <= i + kv_len - qo_len`.
* Custom mask ("Mask Layout (2D Ragged Tensor)"): request b's bool mask `[qo_len, kv_len]`
  (True = visible) is flattened row-major, the requests concatenated, with the implicit
  `mask_indptr[1:] = cumsum(qo_len * kv_len)`; packed 1 bit per element in "little" bit order.
  The kernel reads request b's bit `i * kv_len + j` at byte `mask_indptr[b]` of the packed buffer,
  bit `offset % 8` (`variants.cuh`). `plan(custom_mask=...)` packs per request
  (`segment_packbits(..., bitorder="little")`), each request padded to a whole byte, and keeps
  byte offsets; `plan(packed_custom_mask=...)` keeps the implicit indptr, in bits (flashinfer PR
  #2201, open in 0.7.2.post1). No causal rule is added to a custom mask.
* Multi-item scoring (`plan()` docstring for `prefix_len_ptr`, `token_pos_in_items_ptr`,
  `token_pos_in_items_len`, `max_item_len_ptr`; kernel `logits_mask_multi_item_scoring`): request
  b's first `prefix_len_ptr[b]` (uint32) positions are the shared prefix; from there on,
  `token_pos_in_items_ptr[b * token_pos_in_items_len + pos - prefix_len]` (uint16, zero padded to
  the stride `token_pos_in_items_len`) is each position's 1-based place in its item, 0 for a
  delimiter: items of 3, 2, 4 tokens read `[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 0]`. A prefix
  query is plain causal; an item query sees the prefix and its own item up to itself; a delimiter
  sees the prefix only. `max_item_len_ptr[b]` (uint16) is the longest item: the kernel skips the
  keys further back, so a smaller value would drop item keys (the fake refuses it).
* run() picks the mask: custom while a packed mask is planned (`_custom_mask_buf`), else causal or
  not as planned; multi-item scoring while `_prefix_len_ptr` is planned, over both (prefill.py).
* Scores `sm_scale * q.k` (`sm_scale` default `1/sqrt(head_dim)`); query head h reads KV head
  `h // (num_qo_heads // num_kv_heads)`; `run(..., return_lse=True)` also returns
  `log2(sum_j exp(s_j))`, float32 `[tokens, num_qo_heads]` (`lse_base="log2"`, the default); a
  query with no visible key gives output 0 and LSE -inf.

`make_module()` builds a module to install as `sys.modules["flashinfer"]`. Its options stand for
other versions: `plan_resets_masks=False` for a `plan()` that leaves an earlier plan's mask
buffers in place, `mask_indptr_attr` for a wrapper keeping the mask offsets under another name.
Features the backend never uses (RoPE, windows, soft caps, CUDA graphs) raise NotImplementedError.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import numpy as np
import torch

VERSION = "0.7.2.post1"


def make_module(
    version: str = VERSION,
    *,
    plan_resets_masks: bool = True,
    mask_indptr_attr: str = "_mask_indptr_buf",
) -> ModuleType:
    """A fresh fake `flashinfer` module; its wrapper classes count their instances and plans."""
    module = ModuleType("flashinfer")
    module.__version__ = version  # type: ignore[attr-defined]
    prefill = {
        "instances": 0,
        "plans": 0,
        "plan_resets_masks": plan_resets_masks,
        "mask_indptr_attr": mask_indptr_attr,
    }
    module.BatchPrefillWithPagedKVCacheWrapper = type(  # type: ignore[attr-defined]
        "BatchPrefillWithPagedKVCacheWrapper", (BatchPrefillWithPagedKVCacheWrapper,), prefill
    )
    module.BatchDecodeWithPagedKVCacheWrapper = type(  # type: ignore[attr-defined]
        "BatchDecodeWithPagedKVCacheWrapper",
        (BatchDecodeWithPagedKVCacheWrapper,),
        {"instances": 0, "plans": 0},
    )
    return module


def _dtype(value: str | torch.dtype) -> torch.dtype:
    return getattr(torch, value) if isinstance(value, str) else value


def _lens(indptr: torch.Tensor) -> list[int]:
    values = indptr.tolist()
    return [end - start for start, end in zip(values, values[1:], strict=False)]


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"fake flashinfer: {what}")


class _PagedWrapper:
    """What the paged prefill and decode wrappers share: the page table, inputs, attention."""

    instances = 0
    plans = 0

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        if kv_layout != "NHD" or use_cuda_graph:
            raise NotImplementedError("fake flashinfer: NHD layout without CUDA graphs only")
        _require(float_workspace_buffer.dtype == torch.uint8, "the workspace is a uint8 buffer")
        self.backend = backend
        type(self).instances += 1

    def _plan_pages(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        shape: tuple[int, int, int, int],
        sm_scale: float | None,
        q_data_type: str | torch.dtype,
        kv_data_type: str | torch.dtype | None,
    ) -> None:
        type(self).plans += 1
        for name, t in (("indptr", indptr), ("indices", indices), ("last", last_page_len)):
            _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        num_qo_heads, num_kv_heads, head_dim, page_size = shape
        _require(num_qo_heads % num_kv_heads == 0, "num_qo_heads must be a multiple of kv heads")
        last = last_page_len.tolist()
        _require(all(1 <= n <= page_size for n in last), "1 <= last_page_len <= page_size")
        bounds = indptr.tolist()
        self.pages = [indices[a:b].long() for a, b in zip(bounds, bounds[1:], strict=False)]
        self.kv_lens = [page_size * (len(p) - 1) + n for p, n in zip(self.pages, last, strict=True)]
        self.shape = shape
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.q_dtype = _dtype(q_data_type)
        self.kv_dtype = self.q_dtype if kv_data_type is None else _dtype(kv_data_type)

    def _keys_values(self, b: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request b's keys and values `[kv_len, Hk, D]`, page by page in sequence order."""
        kv = cache[self.pages[b]].transpose(0, 1).flatten(1, 2)[:, : self.kv_lens[b]]
        return kv[0], kv[1]

    def _check_inputs(self, q: torch.Tensor, cache: torch.Tensor, num_rows: int) -> None:
        num_qo_heads, num_kv_heads, head_dim, page_size = self.shape
        _require(q.dtype == self.q_dtype, f"q is {q.dtype}, planned {self.q_dtype}")
        _require(cache.dtype == self.kv_dtype, f"KV is {cache.dtype}, planned {self.kv_dtype}")
        _require(tuple(q.shape) == (num_rows, num_qo_heads, head_dim), f"q shape {q.shape}")
        want = (2, page_size, num_kv_heads, head_dim)
        _require(cache.dim() == 5 and tuple(cache.shape[1:]) == want, f"cache {cache.shape}")

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax attention of `q [qo, Hq, D]` under `visible [qo, kv]`; base-2 LSE `[qo, Hq]`."""
        group = q.shape[1] // k.shape[1]
        # Query head h reads KV head h // group.
        k, v = (x.float().repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("ihd,jhd->hij", q.float(), k) * self.sm_scale
        scores = scores.masked_fill(~visible, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [Hq, qo], -inf where nothing is visible
        probs = torch.exp(scores - lse[..., None]).nan_to_num(nan=0.0)
        out = torch.einsum("hij,jhd->ihd", probs, v)
        return out.to(q.dtype), (lse / math.log(2.0)).transpose(0, 1).contiguous()

    def _run(
        self, q: torch.Tensor, cache: torch.Tensor, qo_lens: list[int], return_lse: bool
    ) -> Any:
        self._check_inputs(q, cache, sum(qo_lens))
        outs, lses, row = [], [], 0
        for b, qo_len in enumerate(qo_lens):
            k, v = self._keys_values(b, cache)
            out, lse = self._attend(q[row : row + qo_len], k, v, self.visible(b))
            outs.append(out)
            lses.append(lse)
            row += qo_len
        out, lse = torch.cat(outs), torch.cat(lses)
        return (out, lse) if return_lse else out

    def visible(self, b: int) -> torch.Tensor:
        raise NotImplementedError


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """`plan()` and `run()` of the paged prefill wrapper, with its 0.7.2.post1 keywords."""

    plan_resets_masks = True
    mask_indptr_attr = "_mask_indptr_buf"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend=backend)
        self._custom_mask_buf: torch.Tensor | None = None
        setattr(self, self.mask_indptr_attr, None)
        self._prefix_len_ptr: torch.Tensor | None = None
        self._token_pos_in_items_ptr: torch.Tensor | None = None
        self._token_pos_in_items_len = 0
        self._max_item_len_ptr: torch.Tensor | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
    ) -> None:
        plain = head_dim_vo in (None, head_dim_qk) and pos_encoding_mode == "NONE"
        if not plain or use_fp16_qk_reduction or window_left != -1 or logits_soft_cap:
            raise NotImplementedError("fake flashinfer: no RoPE, window, soft cap or f16 reduction")
        _require(qo_indptr.dtype == torch.int32, "qo_indptr must be int32")
        shape = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        self._plan_pages(
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            shape,
            sm_scale,
            q_data_type,
            kv_data_type,
        )
        self.qo_lens = _lens(qo_indptr)
        _require(len(self.qo_lens) == len(self.kv_lens), "one qo and one kv range per request")
        self.causal = causal
        self._plan_custom_mask(custom_mask, packed_custom_mask)
        if prefix_len_ptr is not None or self.plan_resets_masks:
            self._plan_multi_item(
                prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr
            )

    def _plan_custom_mask(self, bools: torch.Tensor | None, packed: torch.Tensor | None) -> None:
        bits = [q * k for q, k in zip(self.qo_lens, self.kv_lens, strict=True)]
        if packed is None and bools is not None:
            _require(bools.numel() == sum(bits), "custom_mask holds sum(qo_len * kv_len) bools")
            flat = bools.reshape(-1).cpu().numpy().astype(bool)
            segments = np.split(flat, np.cumsum(bits)[:-1])
            packed_np = [np.packbits(s, bitorder="little") for s in segments]
            packed = torch.from_numpy(np.concatenate(packed_np))
            indptr = np.cumsum([0] + [len(s) for s in packed_np])  # bytes
        else:
            indptr = np.cumsum([0] + bits)  # the implicit indptr of the bool layout, in bits
        if packed is not None:
            _require(packed.dtype == torch.uint8, "packed_custom_mask must be uint8")
            self._custom_mask_buf = packed
            setattr(self, self.mask_indptr_attr, torch.from_numpy(indptr.astype(np.int32)))
        elif self.plan_resets_masks:
            self._custom_mask_buf = None
            setattr(self, self.mask_indptr_attr, None)

    def _plan_multi_item(
        self,
        prefix_len_ptr: torch.Tensor | None,
        token_pos_in_items_ptr: torch.Tensor | None,
        token_pos_in_items_len: int,
        max_item_len_ptr: torch.Tensor | None,
    ) -> None:
        if prefix_len_ptr is not None:
            batch = len(self.qo_lens)
            _require(prefix_len_ptr.dtype == torch.uint32, "prefix_len_ptr must be uint32")
            for name, t in (("token_pos", token_pos_in_items_ptr), ("max", max_item_len_ptr)):
                _require(t is not None and t.dtype == torch.uint16, f"{name} ptr must be uint16")
            assert token_pos_in_items_ptr is not None and max_item_len_ptr is not None
            _require(prefix_len_ptr.numel() == max_item_len_ptr.numel() == batch, "one per request")
            _require(token_pos_in_items_ptr.numel() >= batch * token_pos_in_items_len, "stride")
        self._prefix_len_ptr = prefix_len_ptr
        self._token_pos_in_items_ptr = token_pos_in_items_ptr
        self._token_pos_in_items_len = token_pos_in_items_len
        self._max_item_len_ptr = max_item_len_ptr

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: torch.Tensor,
        *,
        return_lse: bool = False,
        lse_base: str = "log2",
    ) -> Any:
        if lse_base != "log2":
            raise NotImplementedError("fake flashinfer: base-2 LSE only")
        return self._run(q, paged_kv_cache, self.qo_lens, return_lse)

    def visible(self, b: int) -> torch.Tensor:
        """Request b's mask `[qo_len, kv_len]` under the mode run() picks (module docstring)."""
        if self._prefix_len_ptr is not None:
            return self._multi_item_visible(b)
        if self._custom_mask_buf is not None:
            return self._custom_visible(b)
        qo_len, kv_len = self.qo_lens[b], self.kv_lens[b]
        i = torch.arange(qo_len)[:, None]
        j = torch.arange(kv_len)[None, :]
        return j <= i + kv_len - qo_len if self.causal else torch.ones(qo_len, kv_len).bool()

    def _custom_visible(self, b: int) -> torch.Tensor:
        qo_len, kv_len = self.qo_lens[b], self.kv_lens[b]
        start = int(getattr(self, self.mask_indptr_attr)[b])  # read as a byte offset
        offset = torch.arange(qo_len * kv_len)
        packed = self._custom_mask_buf
        assert packed is not None
        bits = (packed.long()[start + offset // 8] >> (offset % 8)) & 1
        return bits.view(qo_len, kv_len).bool()

    def _multi_item_visible(self, b: int) -> torch.Tensor:
        assert self._token_pos_in_items_ptr is not None and self._max_item_len_ptr is not None
        assert self._prefix_len_ptr is not None
        qo_len, kv_len = self.qo_lens[b], self.kv_lens[b]
        prefix_len = int(self._prefix_len_ptr[b])
        stride = self._token_pos_in_items_len
        token_pos = self._token_pos_in_items_ptr.long()[b * stride : (b + 1) * stride].tolist()
        max_item_len = int(self._max_item_len_ptr[b])
        visible = torch.zeros(qo_len, kv_len, dtype=torch.bool)
        for i in range(qo_len):
            pos = i + kv_len - qo_len
            if pos < prefix_len:
                visible[i, : pos + 1] = True  # a prefix query: plain causal
                continue
            _require(pos - prefix_len < stride, f"token_pos_in_items misses position {pos}")
            t = token_pos[pos - prefix_len]
            _require(t <= max_item_len, f"an item of {t}+ tokens, max_item_len_ptr {max_item_len}")
            visible[i, :prefix_len] = True
            visible[i, pos - t + 1 : pos + 1] = True  # its own item up to itself (none: delimiter)
        return visible


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """`plan()` and `run()` of the decode wrapper: one query per request, seeing its whole KV."""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        *,
        backend: str = "auto",
    ) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend=backend)
        self.use_tensor_cores = use_tensor_cores

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
    ) -> None:
        if pos_encoding_mode != "NONE" or window_left != -1 or logits_soft_cap:
            raise NotImplementedError("fake flashinfer: no RoPE, window or soft cap")
        shape = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self._plan_pages(indptr, indices, last_page_len, shape, sm_scale, q_data_type, kv_data_type)

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor, *, return_lse: bool = False
    ) -> Any:
        return self._run(q, paged_kv_cache, [1] * len(self.kv_lens), return_lse)

    def visible(self, b: int) -> torch.Tensor:
        return torch.ones(1, self.kv_lens[b], dtype=torch.bool)
