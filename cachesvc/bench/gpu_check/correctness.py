"""What the GPU check compares, and when a result passes.

Phase 2 runs every scheme on the device and compares it with the torch backend on CPU copies of
the same tensors, twice: in float32 (the truth) and in the checked dtype (what a correct
half-precision kernel gets wrong). A scheme passes when its error against float32 is at most
`ERROR_RATIO` times the torch backend's own error in that dtype, its base-2 LSE within
`LSE_ATOL` of float32's, and its empty rows the same. Phase 3's greedy tokens must agree with
the torch backend's until the two part at a near-tie (`greedy_agreement`).

Pure apart from the kernels they run; `gpu_check` records the comparisons in the run's report,
and the FlashInfer backend's tests reuse the cases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention.base import AttentionBackend, with_lse
from workers.attention.merge import merge_state
from workers.attention.schemes import build_scheme_layout

# A kernel may be up to twice as far from float32 as the torch backend in the same dtype (whose
# CPU kernel, like FA2, rounds the softmax weights to that dtype before multiplying by V).
ERROR_RATIO = 2.0
# Base-2 LSE, by dtype: FA2 sums the softmax weights after rounding them to the dtype (2^-9 /
# 2^-12 relative at worst), so its LSE is that far from float32's; the output check above is
# the one that catches a wrong mask.
LSE_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


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
    """M requests `[prefix P | suffix S]` whose tables share the prefix's full pages; each
    request's own first page starts with the same copy of the prefix's partial last page."""

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
    tail = p - shared * ps  # prefix tokens past the shared pages: the same K/V in every copy
    for table in tables[1:]:
        cache[table[shared], :, :tail] = cache[tables[0][shared], :, :tail]
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
        # The second step of batch split + cache: every suffix against its cached prefix.
        "split": ("split", [s] * m, full, {}),
        "ragged": ("ragged", mixed, full, {}),
        "cascade": ("cascade", [s] * m, full, cascade),
        "multi_item": ("multi_item", mixed, full, items),
        "custom_mask": ("custom_mask", mixed, full, items),
        "decode": ("ragged", [1] * m, full, {}),
        "cascade_decode": ("cascade", [1] * m, full, cascade),
    }


def attention(
    backend: AttentionBackend,
    q: torch.Tensor,
    cache: torch.Tensor,
    step: Step,
    case: Case,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's (out, base-2 LSE) through a scheme backend, as the runner drives it;
    `sm_scale` defaults to 1/sqrt(head_dim)."""
    scheme, qo_lens, kv_lens, extra = step
    device = str(cache.device)
    layout = build_scheme_layout(
        scheme, qo_lens, kv_lens, case.tables, cache.shape[2], device=device, **extra
    )
    backend.plan(layout)
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    return with_lse(
        backend.forward(q[: sum(qo_lens)], cache, layout, sm_scale=scale, return_lse=True)
    )


@dataclass(frozen=True)
class Comparison:
    """A result against float32, beside the torch backend's in the same dtype."""

    ok: bool
    max_out_err: float  # the result against float32
    ref_out_err: float  # the torch backend in the result's dtype against float32
    max_lse_err: float

    @property
    def ratio(self) -> float:
        if self.ref_out_err:
            return self.max_out_err / self.ref_out_err
        return 0.0 if self.max_out_err == 0 else math.inf


def compare(
    got: Sequence[torch.Tensor], low: Sequence[torch.Tensor], want: Sequence[torch.Tensor]
) -> Comparison:
    """Whether (out, lse) `got` passes against float32 `want`, given `low`, the reference's own
    result in got's dtype: output error within `ERROR_RATIO` times low's, base-2 LSE within
    `LSE_ATOL` of got's dtype, and no-key rows (LSE -inf) the same in both."""
    out, lse = got[0].float().cpu(), got[1].float().cpu()
    ref_out, ref_lse = want[0].float().cpu(), want[1].float().cpu()
    out_err = float((out - ref_out).abs().max())
    ref_err = float((low[0].float().cpu() - ref_out).abs().max())
    finite = torch.isfinite(ref_lse)
    lse_err = float((lse - ref_lse)[finite].abs().max()) if finite.any() else 0.0
    same_empty = torch.equal(torch.isfinite(lse), finite)
    ok = same_empty and out_err <= ERROR_RATIO * ref_err and lse_err <= LSE_ATOL[got[0].dtype]
    return Comparison(ok, out_err, ref_err, lse_err)


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
    v_cpu, s_cpu = [x.cpu() for x in v], [x.cpu() for x in s]
    low = merge_state(v_cpu[0], s_cpu[0], v_cpu[1], s_cpu[1])
    want = merge_state(v_cpu[0].float(), s_cpu[0], v_cpu[1].float(), s_cpu[1])
    return compare(got, low, want)


# ---- greedy tokens -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pick:
    """One greedy step: the token taken, the top logit, and its lead over the runner-up."""

    token: int
    top: float
    gap: float

    @classmethod
    def of(cls, logits: torch.Tensor) -> Pick:
        """The greedy pick of a logits row `[vocab]` (argmax, as the engine's sampler takes)."""
        logits = logits.float()
        top, second = logits.topk(2).values.tolist()
        return cls(int(logits.argmax()), top, top - second)


def logit_step(value: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype` numbers at `value`: the finest difference a logit can show."""
    info = torch.finfo(dtype)
    return info.eps * 2.0 ** math.floor(math.log2(max(abs(value), info.tiny)))


def gap_resolution(low: torch.Tensor, want: torch.Tensor) -> float:
    """How far a correct run in `dtype` moves a top-2 logit gap: the largest error, against
    float32 `want`, of the gap between float32's top two tokens in the same rows of `low` (the
    torch backend in `dtype`).

    `low`, `want` are teacher-forced logits `[rows, vocab]`: the resolution the dtype gives this
    model's greedy choices, measured rather than guessed (bf16 rounding through 30 layers moves
    a gap by several times the spacing of the logits themselves).
    """
    top2 = want.float().topk(2, dim=-1)
    gap_want = top2.values[:, 0] - top2.values[:, 1]
    at = low.float().gather(1, top2.indices)
    return float((at[:, 0] - at[:, 1] - gap_want).abs().max())


@dataclass(frozen=True)
class GreedyAgreement:
    """Greedy sequences of a backend against the torch backend's, step by step."""

    ok: bool
    compared: int  # steps compared: equal tokens, or the step at which a sequence parted
    near_ties: int  # steps compared whose top-2 gap was under the resolution in either run
    parted: int  # sequences that parted at a near-tie (and were compared no further)
    first_mismatch: str = ""  # where a sequence parted without a near-tie


def greedy_agreement(
    got: Sequence[Sequence[Pick]],
    want: Sequence[Sequence[Pick]],
    resolution: float,
    dtype: torch.dtype,
) -> GreedyAgreement:
    """`got` passes when each sequence takes `want`'s tokens at every step until the two part
    at a near-tie: a step whose top-2 gap, in either run, is under `resolution` (or under one
    `logit_step` of its top logit). Both runs saw the same tokens up to that step, so a choice
    made with a clear lead must be the same; after parting, their inputs differ."""
    compared = near_ties = parted = 0
    for seq, (got_seq, want_seq) in enumerate(zip(got, want, strict=True)):
        for step, (a, b) in enumerate(zip(got_seq, want_seq, strict=True)):
            compared += 1
            floor = max(resolution, logit_step(a.top, dtype), logit_step(b.top, dtype))
            tie = min(a.gap, b.gap) < floor
            near_ties += tie
            if a.token == b.token:
                continue
            if not tie:
                where = f"sequence {seq} step {step}: {a} vs {b}, resolution {floor:.3g}"
                return GreedyAgreement(False, compared, near_ties, parted, where)
            parted += 1
            break
    return GreedyAgreement(True, compared, near_ties, parted)
