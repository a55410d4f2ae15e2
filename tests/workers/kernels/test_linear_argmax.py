"""The LM head's argmax found in the packed kernel's pass (`packed_linear_argmax`): the same
logits as `packed_linear`, and the index torch's and NumPy's argmax give — the first of equals,
within a panel of 64 columns and across panels, the first NaN wherever it lies, -0.0 equal to
0.0, -inf rows, a last panel cut short — and the fallback where the kernel does not take the
call."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from workers.kernels import linear as kernel

needs_kernel = pytest.mark.skipif(not kernel.load(), reason="no C++ compiler: F.linear is used")


def _fused(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    argmax = torch.full((x.shape[0],), -1, dtype=torch.int64)
    out = kernel.packed_linear_argmax(x, kernel.pack(w), w.shape[0], argmax)
    return out, argmax


def _one_row(values: list[float]) -> int:
    """The fused argmax of one output row holding exactly `values` (x = [1], w = values)."""
    w = torch.tensor(values, dtype=torch.float32)[:, None]
    out, argmax = _fused(torch.ones(1, 1), w)
    torch.testing.assert_close(out[0], w[:, 0], atol=0, rtol=0, equal_nan=True)
    return int(argmax[0])


@needs_kernel
@pytest.mark.parametrize(
    ("m", "n", "k"), [(64, 49152, 64), (1, 7, 33), (7, 65, 16), (97, 1000, 20)]
)
def test_argmax_and_logits_match_a_separate_pass(m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 7 + n)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    out, argmax = _fused(x, w)
    assert torch.equal(out, kernel.packed_linear(x, kernel.pack(w), n))
    assert torch.equal(argmax, out.argmax(dim=-1))


@needs_kernel
def test_ties_go_to_the_first_column_within_and_across_panels() -> None:
    # Small integers: the outputs are exact and tie often, in one panel and across many.
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(-1, 2, (40, 3), generator=gen).float()
    w = torch.randint(-1, 2, (300, 3), generator=gen).float()
    out, argmax = _fused(x, w)
    assert torch.equal(argmax, torch.from_numpy(out.numpy().argmax(axis=-1)))
    assert torch.equal(argmax, out.argmax(dim=-1))
    ties = (out == out.max(dim=-1, keepdim=True).values).sum(dim=-1)
    assert (ties > 1).all(), "the case must tie in every row to test the rule"


@needs_kernel
@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0] * 200, 0),  # all equal: the first
        ([0.0] * 70 + [5.0] + [0.0] * 60 + [5.0], 70),  # equal maxima in panels 1 and 2
        ([9.0] + [0.0] * 100 + [math.nan] + [math.nan], 101),  # a NaN beats any value
        ([math.nan] + [0.0] * 70 + [math.nan], 0),
        ([-math.inf] * 130, 0),  # nothing but -inf
        ([-math.inf] * 129 + [-1e30], 129),  # in the last panel, cut to 2 of 64 columns
        ([-0.0, 0.0], 0),  # -0.0 equals 0.0
        ([0.0] * 64 + [-0.0] + [math.inf] + [math.inf], 65),
    ],
)
def test_special_values_follow_argmax(values: list[float], expected: int) -> None:
    assert torch.tensor(values).argmax().item() == expected  # the rule, as torch states it
    assert _one_row(values) == expected


@needs_kernel
def test_refuses_bfloat16_and_a_wrong_argmax() -> None:
    w = torch.randn(70, 8)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.packed_linear_argmax(
            torch.randn(2, 8).bfloat16(), kernel.pack(w.bfloat16()), 70, torch.empty(2).long()
        )
    with pytest.raises(RuntimeError, match="argmax"):
        kernel.packed_linear_argmax(torch.randn(2, 8), kernel.pack(w), 70, torch.empty(3).long())


@pytest.mark.parametrize(("dtype", "packed"), [(torch.bfloat16, True), (torch.float32, False)])
def test_calls_the_kernel_does_not_take_fill_the_argmax_from_the_output(
    dtype: torch.dtype, packed: bool
) -> None:
    gen = torch.Generator().manual_seed(9)
    x, w = (
        torch.randn(5, 33, generator=gen).to(dtype),
        torch.randn(130, 33, generator=gen).to(dtype),
    )
    packs = kernel.PackedWeights() if packed else None
    argmax = torch.full((5,), -1, dtype=torch.int64)
    out = kernel.linear_argmax(x, w, argmax, packs=packs, name="head")
    assert torch.equal(out, kernel.linear(x, w, None, packs=packs, name="head"))
    assert torch.equal(argmax, out.float().argmax(dim=-1))


@needs_kernel
def test_the_packed_path_uses_the_fused_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = kernel.packed_linear_argmax

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kernel, "packed_linear_argmax", counted)
    x, w = torch.randn(3, 16), torch.randn(200, 16)
    packs = kernel.PackedWeights()
    argmax = torch.full((3,), -1, dtype=torch.int64)
    out = kernel.linear_argmax(x, w, argmax, packs=packs, name="head")
    torch.testing.assert_close(out, F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(argmax, out.argmax(dim=-1))
    assert calls == [1]
