"""What phase 2 of the GPU check compares: every scheme on the device against the torch backend.

The cases, the steps each scheme runs, and the comparison of a result with its float32 reference
within `TOLERANCE`. Pure apart from the kernels they run; `gpu_check.phase_correctness` records
the comparisons in the run's report, and the FlashInfer backend's tests reuse the cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention.base import AttentionBackend, with_lse
from workers.attention.merge import merge_state
from workers.attention.schemes import build_scheme_layout

# Tolerances against float32 (research notes §10): output atol = rtol, base-2 LSE atol.
TOLERANCE = {torch.float16: (4e-3, 1e-2), torch.bfloat16: (2e-2, 1e-2)}


@dataclass(frozen=True)
class Shapes:
    """Dtype, head counts, head dim and page size of one set of checks."""

    dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int = 16


CHECK_SHAPES = (Shapes(torch.float16, 32, 8, 128), Shapes(torch.bfloat16, 9, 3, 64))
CASES = [(p, s, m) for p in (96, 100) for s in (4, 17) for m in (2, 5)]  # (P, S, M)


@dataclass(frozen=True)
class Case:
    """M requests `[prefix P | suffix S]` whose tables share the prefix's full pages."""

    p: int
    s: int
    m: int
    tables: list[list[int]]
    kv_cache: torch.Tensor  # on the device, in the checked dtype
    q: torch.Tensor  # [M * (P + S), Hq, D]: enough rows for any step

    @property
    def groups(self) -> list[list[int]]:
        """Two multi-item groups (one when M < 2 would leave one empty)."""
        half = max(1, self.m // 2)
        return [g for g in (list(range(half)), list(range(half, self.m))) if g]


def make_check_case(p: int, s: int, m: int, shapes: Shapes, device: str) -> Case:
    gen = torch.Generator().manual_seed(p * 100 + s * 10 + m)
    ps, full = shapes.page_size, p + s
    shared = p // ps
    own = -(-(full - shared * ps) // ps)
    tables = [list(range(shared)) + [shared + r * own + i for i in range(own)] for r in range(m)]
    cache = torch.randn(
        shared + m * own, 2, ps, shapes.num_kv_heads, shapes.head_dim, generator=gen
    )
    q = torch.randn(m * full, shapes.num_qo_heads, shapes.head_dim, generator=gen)
    return Case(p, s, m, tables, cache.to(device, shapes.dtype), q.to(device, shapes.dtype))


Step = tuple[str, list[int], list[int], dict[str, Any]]


def scheme_steps(case: Case) -> dict[str, Step]:
    """Named steps: (scheme, qo_lens, kv_lens, extra arguments of build_scheme_layout)."""
    p, s, m, ps = case.p, case.s, case.m, case.kv_cache.shape[2]
    full, mixed = [p + s] * m, [p + s] + [s] * (m - 1)
    cascade = {"groups": [list(range(m))], "shared_num_pages": [p // ps]}
    items = {"groups": case.groups, "prefix_lens": [p] * len(case.groups)}
    return {
        "naive": ("naive", full, full, {}),
        "ragged": ("ragged", mixed, full, {}),
        "cascade": ("cascade", [s] * m, full, cascade),
        "multi_item": ("multi_item", mixed, full, items),
        "custom_mask": ("custom_mask", mixed, full, items),
        "decode": ("ragged", [1] * m, full, {}),
        "cascade_decode": ("cascade", [1] * m, full, cascade),
    }


def attention(
    backend: AttentionBackend, q: torch.Tensor, cache: torch.Tensor, step: Step, case: Case
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's (out, base-2 LSE) through a scheme backend, as the runner drives it."""
    scheme, qo_lens, kv_lens, extra = step
    device = str(cache.device)
    layout = build_scheme_layout(
        scheme, qo_lens, kv_lens, case.tables, cache.shape[2], device=device, **extra
    )
    backend.plan(layout)
    scale = q.shape[-1] ** -0.5
    return with_lse(
        backend.forward(q[: sum(qo_lens)], cache, layout, sm_scale=scale, return_lse=True)
    )


@dataclass(frozen=True)
class Comparison:
    """A result against its float32 reference: within tolerance, and the largest errors."""

    ok: bool
    max_out_err: float
    max_lse_err: float


def compare(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> Comparison:
    """Whether (out, lse) `got` matches `want` within `TOLERANCE` of got's dtype.

    Rows with no visible key must be empty (LSE -inf) in both; other LSEs are compared.
    """
    atol, lse_atol = TOLERANCE[got[0].dtype]
    out, lse = got[0].float().cpu(), got[1].float().cpu()
    ref_out, ref_lse = want[0].float().cpu(), want[1].float().cpu()
    out_err = (out - ref_out).abs()
    out_ok = bool((out_err <= atol + atol * ref_out.abs()).all())
    finite = torch.isfinite(ref_lse)
    lse_err = (lse - ref_lse)[finite].abs().max() if finite.any() else torch.tensor(0.0)
    same_empty = torch.equal(torch.isfinite(lse), finite)
    ok = out_ok and same_empty and float(lse_err) <= lse_atol
    return Comparison(ok, float(out_err.max()), float(lse_err))


def compare_merge_state(shapes: Shapes, backend: str, device: str) -> Comparison:
    """FlashInfer's merge_state (ours for another backend) against ours, with empty states."""
    gen = torch.Generator().manual_seed(7)
    n, h, d = 64, shapes.num_qo_heads, shapes.head_dim
    v = [torch.randn(n, h, d, generator=gen).to(device, shapes.dtype) for _ in range(2)]
    s = [torch.randn(n, h, generator=gen).mul(4).to(device) for _ in range(2)]
    s[0][:4] = float("-inf")  # one side empty; both empty on rows 0-1
    s[1][:2] = float("-inf")
    if backend == "flashinfer":
        import flashinfer

        got = flashinfer.merge_state(v[0], s[0], v[1], s[1])
    else:
        got = merge_state(v[0], s[0], v[1], s[1])
    want = merge_state(v[0].float().cpu(), s[0].cpu(), v[1].float().cpu(), s[1].cpu())
    return compare(got, want)
