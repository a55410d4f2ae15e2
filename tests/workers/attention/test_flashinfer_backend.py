"""The FlashInfer backend: its import, version and errors, and its plumbing on CPU; its kernels
on a GPU.

On CPU `fake_flashinfer` stands in (FlashInfer's documented wrappers, in plain torch; see
test_attention_semantics.py for every scheme against dense attention). Here: the version pin, the
plan-time check of the wrapper attributes the backend writes, plan reuse across layers, dtypes and
KV writes. The `gpu` tests run the real kernels with the GPU check's criteria.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType

import fake_flashinfer
import pytest
import torch

from cachesvc.bench.gpu_check import correctness as gpu_check_correctness
from workers.attention import flashinfer_backend as fb
from workers.attention import get_backend
from workers.attention.layout import BatchLayout, build_layout
from workers.attention.schemes import SchemeBackend, build_scheme_layout, make_scheme_backend
from workers.attention.torch_backend import TorchBackend

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and flashinfer")
CPU = gpu_check_correctness.Shapes(torch.float16, 4, 2, 16, page_size=4)


def test_get_backend_without_cuda_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"needs CUDA and flashinfer-python .*\.\[gpu\]"):
        get_backend("flashinfer")


def test_missing_package_says_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # makes `import flashinfer` fail
    with pytest.raises(RuntimeError, match="flashinfer-python"):
        fb.FlashInferBackend()


# ---- the version and the wrapper attributes the backend relies on -------------------------------


def test_another_flashinfer_version_is_refused_naming_both(
    install_flashinfer: Callable[..., ModuleType],
) -> None:
    install_flashinfer(version="0.6.3")
    pinned = r"needs flashinfer-python==0\.7\.2\.post1.* but 0\.6\.3 is installed"
    with pytest.raises(RuntimeError, match=pinned):
        fb.FlashInferBackend()


def test_a_local_build_tag_names_the_pinned_release(
    install_flashinfer: Callable[..., ModuleType],
) -> None:
    install_flashinfer(version=f"{fb.FLASHINFER_VERSION}+cu130")
    fb.FlashInferBackend()


def test_the_pin_is_the_version_the_fake_stands_for() -> None:
    assert fb.FLASHINFER_VERSION == fake_flashinfer.VERSION


def test_a_wrapper_without_the_buffers_the_backend_sets_is_refused_at_plan(
    install_flashinfer: Callable[..., ModuleType],
) -> None:
    """A flashinfer whose wrapper keeps its mask offsets under another name than
    `_mask_indptr_buf`: the backend's byte offsets would go nowhere, so plan() refuses."""
    install_flashinfer(mask_indptr_attr="_mask_indptr")
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    _, qo_lens, kv_lens, _ = gpu_check_correctness.scheme_steps(case)["ragged"]
    layout = build_layout(qo_lens, kv_lens, case.tables, CPU.page_size)
    backend = fb.FlashInferBackend()
    with pytest.raises(RuntimeError, match=r"flashinfer 0\.7\.2\.post1: .*no _mask_indptr_buf"):
        backend.forward(case.q[: sum(qo_lens)], case.kv_cache, layout, sm_scale=0.25)


# ---- plumbing: plans, dtypes, writes -------------------------------------------------------------


def test_one_plan_per_layout_serves_every_layer(fake_fi: ModuleType) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    _, qo_lens, kv_lens, _ = gpu_check_correctness.scheme_steps(case)["ragged"]
    backend = fb.FlashInferBackend()
    q = case.q[: sum(qo_lens)]

    def layers(layout: BatchLayout, n: int = 3) -> None:
        for _ in range(n):
            backend.forward(q, case.kv_cache, layout, sm_scale=0.25)

    first = build_layout(qo_lens, kv_lens, case.tables, CPU.page_size)
    wrappers = fake_fi.BatchPrefillWithPagedKVCacheWrapper
    backend.plan(first)
    layers(first)
    assert wrappers.plans == 1
    layers(build_layout(qo_lens, kv_lens, case.tables, CPU.page_size))  # a new step's layout
    assert wrappers.plans == 2
    backend.plan(first)  # plan() forgets the previous plan, even of the same layout
    layers(first)
    assert wrappers.plans == 3


def test_cascade_keeps_one_plan_per_level_across_layers(fake_fi: ModuleType) -> None:
    """Each level plans once on its own instance; the layers after the first only run."""
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    scheme, qo_lens, kv_lens, extra = gpu_check_correctness.scheme_steps(case)["cascade"]
    layout = build_scheme_layout(scheme, qo_lens, kv_lens, case.tables, CPU.page_size, **extra)
    backend = SchemeBackend(fb.FlashInferBackend(), fb.FlashInferBackend())
    q = case.q[: sum(qo_lens)]
    backend.plan(layout)
    for _ in range(3):
        backend.forward(q, case.kv_cache, layout, sm_scale=0.25)
    assert fake_fi.BatchPrefillWithPagedKVCacheWrapper.plans == 2


def test_logical_layouts_plan_once_for_every_layer(fake_fi: ModuleType) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    backend = fb.FlashInferBackend()
    for name in ("multi_item", "custom_mask"):
        scheme, qo_lens, kv_lens, extra = gpu_check_correctness.scheme_steps(case)[name]
        layout = build_scheme_layout(scheme, qo_lens, kv_lens, case.tables, 4, **extra)
        q = case.q[: sum(qo_lens)]
        before = fake_fi.BatchPrefillWithPagedKVCacheWrapper.plans
        backend.plan(layout)
        for _ in range(3):
            backend.forward(q, case.kv_cache, layout, sm_scale=0.25)
        assert fake_fi.BatchPrefillWithPagedKVCacheWrapper.plans == before + 1, name


def test_float32_is_refused_with_a_hint(fake_fi: ModuleType) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    layout = build_layout([1, 1], [11, 11], case.tables, CPU.page_size)
    with pytest.raises(ValueError, match="bfloat16"):
        fb.FlashInferBackend().forward(case.q[:2].float(), case.kv_cache, layout, sm_scale=0.25)


def test_write_kv_matches_torch_backend(fake_fi: ModuleType) -> None:
    case = gpu_check_correctness.make_check_case(8, 3, 2, CPU, "cpu")
    step = gpu_check_correctness.scheme_steps(case)["ragged"]
    got, want = case.kv_cache.clone(), case.kv_cache.clone()
    layout = build_layout(step[1], step[2], case.tables, CPU.page_size)
    k, v = torch.randn(2, layout.num_tokens, 2, 16, dtype=CPU.dtype).unbind(0)
    fb.FlashInferBackend().write_kv(got, layout, k, v)
    TorchBackend().write_kv(want, layout, k, v)
    assert torch.equal(got, want)


# ---- the real kernels --------------------------------------------------------------------------


def _on_gpu_and_references(
    backend: SchemeBackend, case: gpu_check_correctness.Case, step: gpu_check_correctness.Step
) -> gpu_check_correctness.Comparison:
    """A step on the GPU against the torch backend on CPU copies, in float32 and in its dtype."""
    reference = make_scheme_backend("torch")
    q, cache = case.q.cpu(), case.kv_cache.cpu()
    got = gpu_check_correctness.attention(backend, case.q, case.kv_cache, step, case)
    low = gpu_check_correctness.attention(reference, q, cache, step, case)
    want = gpu_check_correctness.attention(reference, q.float(), cache.float(), step, case)
    assert got[0].dtype == case.q.dtype and got[1].dtype == torch.float32
    return gpu_check_correctness.compare(got, low, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shapes", gpu_check_correctness.CHECK_SHAPES, ids=lambda s: str(s.dtype))
@pytest.mark.parametrize(("p", "s", "m"), [(96, 17, 5), (100, 4, 2)])
def test_kernels_match_torch_backend(
    shapes: gpu_check_correctness.Shapes, p: int, s: int, m: int
) -> None:
    """Every scheme on the GPU within 2x the torch backend's own error in the same dtype."""
    case = gpu_check_correctness.make_check_case(p, s, m, shapes, "cuda")
    backend = make_scheme_backend("flashinfer")
    for name, step in gpu_check_correctness.scheme_steps(case).items():
        result = _on_gpu_and_references(backend, case, step)
        assert result.ok, (name, result)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shapes", gpu_check_correctness.CHECK_SHAPES, ids=lambda s: str(s.dtype))
def test_tensor_core_decode_matches_cuda_core_decode(shapes: gpu_check_correctness.Shapes) -> None:
    case = gpu_check_correctness.make_check_case(100, 4, 5, shapes, "cuda")
    step = gpu_check_correctness.scheme_steps(case)["decode"]
    for tensor_cores in (False, True):
        backend = SchemeBackend(fb.FlashInferBackend(decode_tensor_cores=tensor_cores))
        result = _on_gpu_and_references(backend, case, step)
        assert result.ok, (tensor_cores, result)
