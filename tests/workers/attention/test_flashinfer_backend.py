"""The FlashInfer backend: its import and errors and its glue on CPU, its kernels on a GPU.

On CPU a fake `flashinfer` stands in: the paged and decode wrappers with the real keyword names
(0.7.2.post1) and mask-mode choice, computing in plain torch, including FlashInfer's bit-sized
`mask_indptr` for a packed custom mask. So the backend's plumbing (index tensors, one-token-page
gathers, plan reuse, the byte-offset fix) is checked everywhere. The `gpu` tests run the real
kernels against the torch backend.
"""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cachesvc.bench import gpu_check_correctness
from workers.attention import flashinfer_backend as fb
from workers.attention import get_backend
from workers.attention.custom_mask import unpack_segment
from workers.attention.layout import BatchLayout, build_layout
from workers.attention.multi_item import multi_item_visible
from workers.attention.ops import attend, causal_mask
from workers.attention.schemes import SchemeBackend, build_scheme_layout, make_scheme_backend
from workers.attention.torch_backend import TorchBackend

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and flashinfer")


def test_get_backend_without_cuda_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs CUDA and flashinfer-python .*\.\[gpu\]"):
        get_backend("flashinfer")


def test_missing_package_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(RuntimeError, match="flashinfer-python"):
        fb.FlashInferBackend()


# ---- a fake flashinfer ---------------------------------------------------------------------------


def _lens(indptr: torch.Tensor) -> list[int]:
    return (indptr[1:] - indptr[:-1]).tolist()


class FakePaged:
    """BatchPrefillWithPagedKVCacheWrapper's plan/run (0.7.2.post1 keywords) in plain torch.

    Mask mode as its run() picks it: multi-item scoring when `prefix_len_ptr` was planned, else
    custom when a packed mask was, else causal / non-causal. Like the real plan(), a packed mask
    gets `mask_indptr` in bits, which only the backend's fix turns into bytes.
    """

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str, *, backend: str) -> None:
        assert kv_layout == "NHD" and backend == "fa2" and workspace.dtype == torch.uint8

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
        *,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        sm_scale: float | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
        prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None,
    ) -> None:
        FakePaged.plans += 1
        tensors = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
        assert all(t.dtype == torch.int32 for t in tensors)
        assert sm_scale is not None  # the backend always passes the model's scale
        self.qo = _lens(qo_indptr)
        pages = _lens(paged_kv_indptr)
        last = paged_kv_last_page_len.tolist()
        self.kv = [(n - 1) * page_size + x for n, x in zip(pages, last, strict=True)]
        self.indptr, self.indices = paged_kv_indptr.tolist(), paged_kv_indices.long()
        self.causal, self.sm_scale, self.mask = causal, sm_scale, packed_custom_mask
        if packed_custom_mask is not None:
            bits = torch.tensor(self.qo) * torch.tensor(self.kv)
            self._mask_indptr_buf = torch.cat([torch.zeros(1, dtype=torch.long), bits.cumsum(0)])
        self.mis = None
        if prefix_len_ptr is not None:
            assert prefix_len_ptr.dtype == torch.uint32 and max_item_len_ptr is not None
            assert token_pos_in_items_ptr is not None
            assert token_pos_in_items_ptr.dtype == max_item_len_ptr.dtype == torch.uint16
            self.mis = (
                prefix_len_ptr.long(),
                token_pos_in_items_ptr.long(),
                token_pos_in_items_len,
            )

    def _visible(self, b: int) -> torch.Tensor:
        qo, kv = self.qo[b], self.kv[b]
        if self.mis is not None:
            prefix, tpi, stride = self.mis
            p = int(prefix[b])
            return multi_item_visible(qo, kv, p, tpi[b * stride : b * stride + kv - p])
        if self.mask is not None:
            start = int(self._mask_indptr_buf[b])
            return unpack_segment(self.mask[start:], qo, kv)
        return causal_mask(qo, kv) if self.causal else torch.ones(qo, kv, dtype=torch.bool)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, *, return_lse: bool = False) -> Any:
        outs, lses, start = [], [], 0
        for b, (qo, kv) in enumerate(zip(self.qo, self.kv, strict=True)):
            pages = self.indices[self.indptr[b] : self.indptr[b + 1]]
            k, v = (kv_cache[pages, i].flatten(0, 1)[:kv] for i in (0, 1))
            visible = self._visible(b)
            o, s = attend(q[start : start + qo], k, v, sm_scale=self.sm_scale, mask=visible)
            outs.append(o)
            lses.append(s)
            start += qo
        out, lse = torch.cat(outs), torch.cat(lses)
        return (out, lse) if return_lse else out


class FakeDecode(FakePaged):
    """BatchDecodeWithPagedKVCacheWrapper: the paged one with one query per request."""

    def __init__(
        self, workspace: torch.Tensor, kv_layout: str, *, use_tensor_cores: bool, backend: str
    ) -> None:
        super().__init__(workspace, kv_layout, backend=backend)

    def plan(  # type: ignore[override]
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        sm_scale: float | None = None,
        q_data_type: torch.dtype = torch.float16,
        kv_data_type: torch.dtype | None = None,
    ) -> None:
        qo_indptr = torch.arange(len(indptr), dtype=torch.int32)
        args = (num_qo_heads, num_kv_heads, head_dim, page_size)
        super().plan(qo_indptr, indptr, indices, last_page_len, *args, sm_scale=sm_scale)


FAKE = SimpleNamespace(
    BatchPrefillWithPagedKVCacheWrapper=FakePaged,
    BatchDecodeWithPagedKVCacheWrapper=FakeDecode,
)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fb, "load_flashinfer", lambda: FAKE)
    monkeypatch.setattr(fb, "WORKSPACE_BYTES", 16)


CPU = gpu_check_correctness.Shapes(torch.float16, 4, 2, 16, page_size=4)


@pytest.mark.parametrize(("p", "s", "m"), [(8, 3, 2), (10, 5, 5)])
def test_every_scheme_runs_the_reference_semantics(fake: None, p: int, s: int, m: int) -> None:
    """Through the fake, each scheme's (out, lse) equals the torch backend's."""
    case = gpu_check_correctness.make_check_case(p, s, m, CPU, "cpu")
    backend = SchemeBackend(fb.FlashInferBackend(), fb.FlashInferBackend())
    reference = make_scheme_backend("torch")
    for name, step in gpu_check_correctness.scheme_steps(case).items():
        got = gpu_check_correctness.attention(backend, case.q, case.kv_cache, step, case)
        want = gpu_check_correctness.attention(reference, case.q, case.kv_cache, step, case)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3, msg=name)


def test_one_plan_per_layout_serves_every_layer(fake: None) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    _, qo_lens, kv_lens, _ = gpu_check_correctness.scheme_steps(case)["ragged"]
    backend = fb.FlashInferBackend()
    q = case.q[: sum(qo_lens)]

    def layers(layout: BatchLayout, n: int = 3) -> None:
        for _ in range(n):
            backend.forward(q, case.kv_cache, layout, sm_scale=0.25)

    first = build_layout(qo_lens, kv_lens, case.tables, CPU.page_size)
    FakePaged.plans = 0
    backend.plan(first)
    layers(first)
    assert FakePaged.plans == 1
    layers(build_layout(qo_lens, kv_lens, case.tables, CPU.page_size))  # a new step's layout
    assert FakePaged.plans == 2
    backend.plan(first)  # plan() forgets the previous plan, even of the same layout
    layers(first)
    assert FakePaged.plans == 3


def test_cascade_keeps_one_plan_per_level_across_layers(fake: None) -> None:
    """Each level plans once on its own instance; the layers after the first only run."""
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    scheme, qo_lens, kv_lens, extra = gpu_check_correctness.scheme_steps(case)["cascade"]
    layout = build_scheme_layout(scheme, qo_lens, kv_lens, case.tables, CPU.page_size, **extra)
    backend = SchemeBackend(fb.FlashInferBackend(), fb.FlashInferBackend())
    q = case.q[: sum(qo_lens)]
    FakePaged.plans = 0
    backend.plan(layout)
    for _ in range(3):
        backend.forward(q, case.kv_cache, layout, sm_scale=0.25)
    assert FakePaged.plans == 2


def test_logical_layouts_plan_once_for_every_layer(fake: None) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    backend = fb.FlashInferBackend()
    for name in ("multi_item", "custom_mask"):
        scheme, qo_lens, kv_lens, extra = gpu_check_correctness.scheme_steps(case)[name]
        layout = build_scheme_layout(scheme, qo_lens, kv_lens, case.tables, 4, **extra)
        q = case.q[: sum(qo_lens)]
        FakePaged.plans = 0
        backend.plan(layout)
        for _ in range(3):
            backend.forward(q, case.kv_cache, layout, sm_scale=0.25)
        assert FakePaged.plans == 1, name


def test_float32_is_refused_with_a_hint(fake: None) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    layout = build_layout([1, 1], [11, 11], case.tables, CPU.page_size)
    with pytest.raises(ValueError, match="bfloat16"):
        fb.FlashInferBackend().forward(case.q[:2].float(), case.kv_cache, layout, sm_scale=0.25)


def test_write_kv_matches_torch_backend(fake: None) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    step = gpu_check_correctness.scheme_steps(case)["ragged"]
    got, want = case.kv_cache.clone(), case.kv_cache.clone()
    layout = build_layout(step[1], step[2], case.tables, CPU.page_size)
    k, v = torch.randn(2, layout.num_tokens, 2, 16, dtype=CPU.dtype).unbind(0)
    fb.FlashInferBackend().write_kv(got, layout, k, v)
    TorchBackend().write_kv(want, layout, k, v)
    assert torch.equal(got, want)


# ---- the real kernels --------------------------------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shapes", gpu_check_correctness.CHECK_SHAPES, ids=lambda s: str(s.dtype))
@pytest.mark.parametrize(("p", "s", "m"), [(96, 17, 5), (100, 4, 2)])
def test_kernels_match_torch_backend(
    shapes: gpu_check_correctness.Shapes, p: int, s: int, m: int
) -> None:
    """Every scheme on the GPU against the torch backend in float32 on CPU copies."""
    case = gpu_check_correctness.make_check_case(p, s, m, shapes, "cuda")
    backend, reference = make_scheme_backend("flashinfer"), make_scheme_backend("torch")
    q_ref, cache_ref = case.q.float().cpu(), case.kv_cache.float().cpu()
    atol, lse_atol = gpu_check_correctness.TOLERANCE[shapes.dtype]
    for name, step in gpu_check_correctness.scheme_steps(case).items():
        out, lse = gpu_check_correctness.attention(backend, case.q, case.kv_cache, step, case)
        want_out, want_lse = gpu_check_correctness.attention(
            reference, q_ref, cache_ref, step, case
        )
        assert out.dtype == shapes.dtype and lse.dtype == torch.float32, name
        torch.testing.assert_close(out.float().cpu(), want_out, atol=atol, rtol=atol, msg=name)
        torch.testing.assert_close(lse.cpu(), want_lse, atol=lse_atol, rtol=0, msg=name)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shapes", gpu_check_correctness.CHECK_SHAPES, ids=lambda s: str(s.dtype))
def test_tensor_core_decode_matches_cuda_core_decode(shapes: gpu_check_correctness.Shapes) -> None:
    case = gpu_check_correctness.make_check_case(100, 4, 5, shapes, "cuda")
    step = gpu_check_correctness.scheme_steps(case)["decode"]
    cuda_cores = SchemeBackend(fb.FlashInferBackend())
    tensor_cores = SchemeBackend(fb.FlashInferBackend(decode_tensor_cores=True))
    want = gpu_check_correctness.attention(cuda_cores, case.q, case.kv_cache, step, case)
    got = gpu_check_correctness.attention(tensor_cores, case.q, case.kv_cache, step, case)
    atol, lse_atol = gpu_check_correctness.TOLERANCE[shapes.dtype]
    torch.testing.assert_close(got[0], want[0], atol=atol, rtol=atol)
    torch.testing.assert_close(got[1], want[1], atol=lse_atol, rtol=0)
