"""Phase 2 of the GPU check: every scheme on the device against the torch backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from cachesvc.gpu_check_run import TOLERANCE, Run
from workers.attention.merge import merge_state
from workers.attention.schemes import SchemeBackend, build_scheme_layout, make_scheme_backend

# ---- phase 2: correctness ----------------------------------------------------------------------


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
    backend: SchemeBackend, q: torch.Tensor, cache: torch.Tensor, step: Step, case: Case
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's (out, base-2 LSE) through a scheme backend, as the runner drives it."""
    scheme, qo_lens, kv_lens, extra = step
    device = str(cache.device)
    layout = build_scheme_layout(
        scheme, qo_lens, kv_lens, case.tables, cache.shape[2], device=device, **extra
    )
    backend.plan(layout)
    scale = q.shape[-1] ** -0.5
    result = backend.forward(q[: sum(qo_lens)], cache, layout, sm_scale=scale, return_lse=True)
    assert isinstance(result, tuple)
    return result


def compare(run: Run, name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> None:
    """Record whether (out, lse) `got` matches `want` (float32 reference) within tolerance."""
    atol, lse_atol = TOLERANCE[got[0].dtype]
    out, lse = got[0].float().cpu(), got[1].float().cpu()
    ref_out, ref_lse = want[0].float().cpu(), want[1].float().cpu()
    out_err = (out - ref_out).abs()
    out_ok = bool((out_err <= atol + atol * ref_out.abs()).all())
    finite = torch.isfinite(ref_lse)
    lse_err = (lse - ref_lse)[finite].abs().max() if finite.any() else torch.tensor(0.0)
    same_empty = torch.equal(torch.isfinite(lse), finite)
    ok = out_ok and same_empty and float(lse_err) <= lse_atol
    run.check(name, ok, max_out_err=float(out_err.max()), max_lse_err=float(lse_err))


def phase_correctness(run: Run) -> None:
    reference = make_scheme_backend("torch")
    for shapes in CHECK_SHAPES:
        backend = make_scheme_backend(run.backend)
        tag = f"{str(shapes.dtype)[6:]}/hd{shapes.head_dim}"
        for p, s, m in CASES:
            case = make_check_case(p, s, m, shapes, run.device)
            q_ref, cache_ref = case.q.float().cpu(), case.kv_cache.float().cpu()
            got: dict[str, Any] = {}
            label = f"{tag} P={p} S={s} M={m}"
            for name, step in scheme_steps(case).items():
                run_step = partial(attention, backend, case.q, case.kv_cache, step, case)
                got[name] = run.guarded(f"{label} {name}", run_step)
                want = attention(reference, q_ref, cache_ref, step, case)
                if got[name] is not None:
                    compare(run, f"{label} {name}", got[name], want)
            for a, b in (("cascade_decode", "decode"), ("multi_item", "custom_mask")):
                if got[a] is not None and got[b] is not None:
                    compare(run, f"{label} {a}=={b}", got[a], got[b])
        run.guarded(f"{tag} merge_state", partial(check_merge_state, run, shapes))


def check_merge_state(run: Run, shapes: Shapes) -> None:
    """FlashInfer's merge_state against ours, with empty (-inf) states in the mix."""
    gen = torch.Generator().manual_seed(7)
    n, h, d = 64, shapes.num_qo_heads, shapes.head_dim
    v = [torch.randn(n, h, d, generator=gen).to(run.device, shapes.dtype) for _ in range(2)]
    s = [torch.randn(n, h, generator=gen).mul(4).to(run.device) for _ in range(2)]
    s[0][:4] = float("-inf")  # one side empty; both empty on rows 0-1
    s[1][:2] = float("-inf")
    if run.backend == "flashinfer":
        import flashinfer

        got = flashinfer.merge_state(v[0], s[0], v[1], s[1])
    else:
        got = merge_state(v[0], s[0], v[1], s[1])
    want = merge_state(v[0].float().cpu(), s[0].cpu(), v[1].float().cpu(), s[1].cpu())
    compare(run, f"{str(shapes.dtype)[6:]}/hd{shapes.head_dim} merge_state", got, want)
