"""The packed-panel linear kernel against `F.linear` in float64, on the model's shapes and odd
ones (outputs not a multiple of its 64-column panels or of 16, K past its 512-long chunks, rows
around its 6-row passes, prefill's hundreds of rows), its results independent of the batch and
the threads, its packed copies kept and remade, and the torch fallback where the kernel is off,
cannot take the call or is not built."""

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
    (65, 16),
    (1, 1),
    (130, 1537),
]
# Sums of K products of unit normals, compared in float64: float32 rounding grows with sqrt(K);
# bfloat16 output is rounded once, to 8 bits (a relative 2^-8), on top of float32 sums.
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((m, k), (n, k), (n,)))
    return x, w, b


def _run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return kernel.packed_linear(x, kernel.pack(w), w.shape[0], b)


def test_pack_lays_out_panels_of_64_columns() -> None:
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3)
    packed = kernel.pack(w)
    assert packed.shape == (2, 3, 64)
    assert torch.equal(packed[1, 2, 5], w[69, 2])  # column 69 is panel 1's sixth
    assert torch.equal(packed[0].T, w[:64])
    assert not packed[1, :, 6:].any(), "the last panel's missing columns are zeros"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 16, 75])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_kernel_matches_f_linear(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x, w, b = _case(m, n, k, dtype, seed=m * 1000 + n + k)
    atol, rtol = TOLERANCES[dtype]
    reference = F.linear(x.double(), w.double(), b.double())
    got = _run(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.double(), reference, atol=atol * k**0.5, rtol=rtol)
    no_bias = _run(x, w)
    torch.testing.assert_close(
        no_bias.double(), reference - b.double(), atol=atol * k**0.5, rtol=rtol
    )


@needs_kernel
def test_a_row_gets_the_same_bits_whatever_its_batch_and_threads() -> None:
    # Each output is summed in order of k: a decode row alone, inside a prefill's rows, split
    # among threads or across K's chunks, gives one result.
    x, w, b = _case(300, 4099, 1100, torch.float32, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = _run(x, w, b)
    finally:
        torch.set_num_threads(before)
    torch.set_num_threads(1)
    try:
        for row in (0, 7, 299):
            alone = _run(x[row : row + 1], w, b)
            torch.testing.assert_close(alone[0], batch[row], atol=0, rtol=0)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_kernel_refuses_mixed_dtypes_and_bad_shapes() -> None:
    x, w, _ = _case(2, 8, 16, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernel.packed_linear(x, kernel.pack(w.bfloat16()), 8)
    with pytest.raises(RuntimeError, match="64 \\(NB - 1\\) < N"):
        kernel.packed_linear(x, kernel.pack(w), 65)


@needs_kernel
def test_no_rows_give_an_empty_output() -> None:
    x, w, b = _case(0, 8, 16, torch.float32, seed=1)
    assert _run(x, w, b).shape == (0, 8)


@needs_kernel
def test_packed_copies_are_kept_and_remade_when_the_weight_changes() -> None:
    packs = kernel.PackedWeights()
    x, w, b = _case(3, 70, 20, torch.float32, seed=6)
    first = packs.of("w", w)
    assert packs.of("w", w) is first, "the same weight: the same copy"
    w.mul_(2)  # modified in place: packed again
    torch.testing.assert_close(packs.linear("w", x, w, b), F.linear(x, w, b))
    other = w.clone()
    assert packs.of("w", other) is not packs.of("w", w)
    packs.clear()


def test_linear_falls_back_to_f_linear_when_the_kernel_is_not_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_kernel(*_: object) -> None:
        raise AssertionError("the kernel must not be called")

    monkeypatch.setattr(kernel, "load", lambda: False)
    monkeypatch.setattr(kernel, "packed_linear", no_kernel)
    x, w, b = _case(3, 7, 33, torch.float32, seed=2)
    packs = kernel.PackedWeights()
    torch.testing.assert_close(kernel.linear(x, w, b, packs=packs, name="w"), F.linear(x, w, b))


@pytest.mark.parametrize(("dtype", "packed"), [(torch.float16, True), (torch.float32, False)])
def test_linear_keeps_f_linear_for_calls_the_kernel_does_not_take(
    dtype: torch.dtype, packed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dtype the kernel lacks, or the kernel switched off (no packed copies).
    def no_kernel(*_: object) -> None:
        raise AssertionError("the kernel must not be called")

    monkeypatch.setattr(kernel, "packed_linear", no_kernel)
    x, w, b = _case(4, 7, 33, dtype, seed=3)
    packs = kernel.PackedWeights() if packed else None
    torch.testing.assert_close(kernel.linear(x, w, b, packs=packs, name="w"), F.linear(x, w, b))


@needs_kernel
def test_linear_uses_the_kernel_at_any_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kernel.packed_linear

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "packed_linear", counted)
    packs = kernel.PackedWeights()
    for m in (1, 17, 400):
        x, w, b = _case(m, 7, 33, torch.float32, seed=4)
        kernel.linear(x, w, b, packs=packs, name="w")
    assert calls == [1, 1, 1]
