"""The CPU prefill-attention kernel against a float64 reference: causal squares, chunks after
cached keys, chunks longer than their keys (early queries see none), unmasked attention, GQA
groups, head dims 64 and 128, lengths off its 6-query and 64-key blocks; its results the same
on any number of threads; bfloat16 within its precision; and `ops.attend` using it where it
takes the call and ATen's flash kernel where it does not."""

from __future__ import annotations

import pytest
import torch

from workers.attention import ops
from workers.attention import prefill_attention as kernel
from workers.attention.ops import attend_dense, causal_mask

needs_kernel = pytest.mark.skipif(not kernel.load(), reason="no C++ compiler: ATen's kernel runs")


def _case(lq: int, lk: int, heads: tuple[int, int], d: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    q = torch.randn(lq, hq, d, generator=gen)
    k = torch.randn(lk, hk, d, generator=gen)
    v = torch.randn(lk, hk, d, generator=gen)
    return q, k, v


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    lq, lk = q.shape[0], k.shape[0]
    visible = causal_mask(lq, lk) if causal else torch.ones(lq, lk, dtype=torch.bool)
    out, lse = attend_dense(
        q[None].double(), k[None].double(), v[None].double(), visible[None], q.shape[-1] ** -0.5
    )
    return out[0].double(), lse[0].double()


@needs_kernel
@pytest.mark.parametrize(
    ("lq", "lk", "causal"),
    [(1, 1, True), (7, 7, True), (130, 130, True), (70, 333, True), (5, 40, False), (20, 9, True)],
)
@pytest.mark.parametrize(("heads", "d"), [((9, 3), 64), ((8, 2), 128), ((4, 4), 64), ((6, 1), 64)])
def test_kernel_matches_reference(
    lq: int, lk: int, causal: bool, heads: tuple[int, int], d: int
) -> None:
    q, k, v = _case(lq, lk, heads, d, seed=lq * 7 + lk)
    out, lse = kernel.prefill_attention(q, k, v, d**-0.5, causal)
    ref_out, ref_lse = _reference(q, k, v, causal)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == q.shape[:2]
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("growth", [4.0, -0.9])
def test_a_maximum_that_moves_in_later_runs_of_keys_rescales_what_came_before(
    growth: float,
) -> None:
    # Keys scaled along their position: the scores' maximum rises run after run (or only the
    # first run holds it), so the kernel's skipped and taken rescales are both exercised.
    q, k, v = _case(150, 333, (9, 3), 64, seed=11)
    k = k * (1 + growth * torch.arange(333, dtype=torch.float32) / 333)[:, None, None]
    out, lse = kernel.prefill_attention(q, k, v, 0.125, True)
    ref_out, ref_lse = _reference(q, k, v, True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_queries_with_no_visible_key_give_zero_and_minus_infinity() -> None:
    # 20 queries after... nothing: causal over 9 keys, so the first 11 see none.
    q, k, v = _case(20, 9, (9, 3), 64, seed=3)
    out, lse = kernel.prefill_attention(q, k, v, 0.125, True)
    assert not out[:11].any()
    assert torch.isneginf(lse[:11]).all() and torch.isfinite(lse[11:]).all()


@needs_kernel
def test_the_same_bits_on_any_number_of_threads() -> None:
    q, k, v = _case(300, 300, (9, 3), 64, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.prefill_attention(q, k, v, 0.125, True)
        torch.set_num_threads(2)
        two = kernel.prefill_attention(q, k, v, 0.125, True)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, two, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@needs_kernel
def test_bfloat16_within_its_precision() -> None:
    q, k, v = (t.bfloat16() for t in _case(90, 150, (9, 3), 64, seed=5))
    out, lse = kernel.prefill_attention(q, k, v, 0.125, True)
    ref_out, ref_lse = _reference(q.float(), k.float(), v.float(), True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_strided_views_of_a_fused_projection_are_taken() -> None:
    # The model's q and k are views of one [T, heads, D] projection: rows strided, heads not.
    qkv = torch.randn(40, 15, 64)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    out, _ = kernel.prefill_attention(q, k, v, 0.125, True)
    ref_out, _ = _reference(q.contiguous(), k.contiguous(), v.contiguous(), True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)


def test_shapes_dtypes_and_cpus_it_does_not_take(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v = _case(4, 4, (4, 4), 24, seed=6)
    assert not kernel.takes(q, k, v), "head dim 24"
    q, k, v = (t.half() for t in _case(4, 4, (4, 4), 64, seed=6))
    assert not kernel.takes(q, k, v), "float16"
    monkeypatch.setattr(kernel, "cpu_capability", lambda: "AVX2")
    assert not kernel.takes(*_case(4, 4, (4, 4), 64, seed=6)), "no AVX-512: ATen's kernel"


@needs_kernel
def test_attend_uses_the_kernel_where_it_takes_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = kernel.prefill_attention

    def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "prefill_attention", counted)
    q, k, v = _case(30, 50, (9, 3), 64, seed=7)
    out, lse = ops.attend(q, k, v, sm_scale=0.125, causal=True)
    assert calls == [1]
    ref_out, ref_lse = _reference(q, k, v, True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    q, k, v = _case(30, 50, (4, 4), 24, seed=7)  # not taken: ATen's kernel, same semantics
    out, lse = ops.attend(q, k, v, sm_scale=24**-0.5, causal=True)
    assert calls == [1]
    torch.testing.assert_close(out.double(), _reference(q, k, v, True)[0], atol=1e-5, rtol=1e-5)
