"""The small-M linear kernel against `F.linear` in float64, on the model's shapes and odd ones
(row counts around the kernel's row blocks, weights not a multiple of its 8-row blocks or of
16 columns), and the
torch fallback where the kernel is off, cannot take the call or is not built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import linear as kernel

needs_kernel = pytest.mark.skipif(not kernel.load(), reason="no C++ compiler: F.linear is used")

# (N, K): SmolLM2's q/k/v, o, gate/up and down, then odd sizes.
SHAPES = [
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (7, 33),
    (13, 600),
    (5, 16),
    (1, 1),
    (3, 1537),
]
# Sums of K products of unit normals, compared in float64: float32 rounding grows with sqrt(K);
# bfloat16 output is rounded once, to 8 bits (a relative 2^-8), on top of float32 sums.
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((m, k), (n, k), (n,)))
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_matches_f_linear(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w, b = _case(m, n, k, dtype, seed=m * 1000 + n + k)
    atol, rtol = TOLERANCES[dtype]
    reference = F.linear(x.double(), w.double(), b.double())
    got = kernel.small_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.double(), reference, atol=atol * k**0.5, rtol=rtol)
    no_bias = kernel.small_linear(x, w)
    torch.testing.assert_close(
        no_bias.double(), reference - b.double(), atol=atol * k**0.5, rtol=rtol
    )


@needs_kernel
def test_kernel_splits_columns_among_threads() -> None:
    x, w, b = _case(16, 4099, 576, torch.float32, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = kernel.small_linear(x, w, b)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(two, kernel.small_linear(x, w, b), atol=0, rtol=0)


@needs_kernel
def test_kernel_refuses_mixed_dtypes() -> None:
    x, w, _ = _case(2, 8, 16, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.small_linear(x, w.bfloat16())


def test_linear_falls_back_to_f_linear_when_the_kernel_is_not_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_kernel(*_: object) -> None:
        raise AssertionError("the kernel must not be called")

    monkeypatch.setattr(kernel, "load", lambda: False)
    monkeypatch.setattr(kernel, "small_linear", no_kernel)
    x, w, b = _case(3, 7, 33, torch.float32, seed=2)
    torch.testing.assert_close(kernel.linear(x, w, b, native=True), F.linear(x, w, b))


@pytest.mark.parametrize(
    ("m", "dtype", "native"),
    [(17, torch.float32, True), (4, torch.float16, True), (4, torch.float32, False)],
)
def test_linear_keeps_f_linear_for_calls_the_kernel_does_not_take(
    m: int, dtype: torch.dtype, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prefill's many rows, a dtype the kernel lacks, or the kernel switched off.
    def no_kernel(*_: object) -> None:
        raise AssertionError("the kernel must not be called")

    monkeypatch.setattr(kernel, "small_linear", no_kernel)
    x, w, b = _case(m, 7, 33, dtype, seed=3)
    torch.testing.assert_close(kernel.linear(x, w, b, native=native), F.linear(x, w, b))


@needs_kernel
def test_linear_uses_the_kernel_at_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kernel.small_linear

    def counted(*args: torch.Tensor | None) -> torch.Tensor:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(kernel, "small_linear", counted)
    x, w, b = _case(16, 7, 33, torch.float32, seed=4)
    kernel.linear(x, w, b, native=True)
    assert calls == [1]
