"""The fused elementwise kernels (`workers/kernels/csrc/fused_ops.cpp`) against torch's ops:
RoPE to the bit, the residual add to the bit, RMSNorm and silu within the last bits, every row
the same whatever the rows around it, and the KV write the same as indexing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers.kernels.fused import load
from workers.model.layer_ops import LayerOps
from workers.model.rope import apply_rope

pytestmark = pytest.mark.skipif(not load(), reason="needs a C++ compiler")
DTYPES = (torch.float32, torch.bfloat16)
ROWS = (1, 3, 17, 700)  # 700 rows share the work among threads


def _ulp(dtype: torch.dtype) -> float:
    return 2.0**-23 if dtype == torch.float32 else 2.0**-7


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm, in float64 up to the rounding to x's dtype."""
    h = x.double()
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w.double() * normed.to(x.dtype).double()).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_gives_torch_bits(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    heads, kv, d = 9, 3, 64
    qkv = torch.randn(rows, (heads + 2 * kv) * d, generator=gen).to(dtype)
    cos = torch.randn(rows, 1, d // 2, generator=gen).to(dtype)
    sin = torch.randn(rows, 1, d // 2, generator=gen).to(dtype)
    got = LayerOps(native=True).rope_qk(qkv, cos, sin, heads + kv, d)
    want = apply_rope(qkv[:, : (heads + kv) * d].view(rows, heads + kv, d), cos, sin)
    assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_adds_exactly_and_normalises_as_hugging_face(
    dtype: torch.dtype, rows: int
) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
    add = torch.randn(rows, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    residual = x.clone()
    got = LayerOps(native=True).add_rms_norm_(residual, add, w, 1e-5)
    assert torch.equal(residual, x + add), "the residual stream is x + add, to the bit"
    want = _hf_rms_norm(x + add, w, 1e-5)
    # float32 roundings of rstd, x * rstd and the product against float64's, and the mean's
    # order of sums: a few steps of the dtype at most.
    scale = want.float().abs().clamp_min(1e-3)
    assert ((got.float() - want.float()).abs() / scale).max() <= 4 * _ulp(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_a_row_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(700, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    ops = LayerOps(native=True)
    together = ops.rms_norm(x, w, 1e-6)
    for row in (0, 9, 699):
        assert torch.equal(ops.rms_norm(x[row : row + 1].clone(), w, 1e-6)[0], together[row])
    assert torch.allclose(together.float(), F.rms_norm(x, (576,), w, 1e-6).float(), rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_within_the_last_bits_of_torch(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 6).to(dtype)
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 80.0, -80.0, 1e4, -1e4, 1e-30, -1e-30]).to(dtype)
    got = LayerOps(native=True).silu_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    want = F.silu(gate) * up
    assert torch.isfinite(got).all()
    scale = want.float().abs().clamp_min(1e-6)
    assert ((got.float() - want.float()).abs() / scale).max() <= 16 * _ulp(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_stores_what_indexing_stores(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    pages, page_size, kv, d, rows = 6, 4, 3, 64, 7
    k = torch.randn(rows, kv, d, generator=gen).to(dtype)
    v = torch.randn(rows, kv, d, generator=gen).to(dtype)
    slots = torch.tensor([0, 5, 6, 23, 13, 2, 17])
    got = torch.zeros(pages, 2, page_size, kv, d, dtype=dtype)
    torch.ops.cachesvc.write_kv(got, slots, k, v)
    want = torch.zeros_like(got)
    want[slots // page_size, :, slots % page_size] = torch.stack((k, v), dim=1)
    assert torch.equal(got, want)


def test_write_kv_refuses_a_slot_outside_the_cache() -> None:
    cache = torch.zeros(2, 2, 4, 1, 64)
    k = v = torch.ones(1, 1, 64)
    with pytest.raises(RuntimeError, match="slot 8 outside 8"):
        torch.ops.cachesvc.write_kv(cache, torch.tensor([8]), k, v)
    assert not cache.any(), "nothing written"


def test_torch_ops_stand_in_where_the_kernel_does_not_apply() -> None:
    x = torch.randn(3, 64, dtype=torch.float64)  # a dtype the kernel does not take
    w = torch.randn(64, dtype=torch.float64)
    got = LayerOps(native=True).rms_norm(x, w, 1e-6)
    assert got.dtype == torch.float64
    assert torch.equal(got, F.rms_norm(x, (64,), w, 1e-6))
    assert not LayerOps(native=False).native
