"""The shared-prefix prefill/decode schemes behind one backend, and the choice between them.

Scheme names follow the seed (shared-prefix-optimizations, §4): "naive", "split" and "ragged"
differ only in what the scheduler put in the batch and are plain paged attention here; "cascade"
runs two levels and merges; "multi_item" and "custom_mask" run each group as one logical request
under a structured or explicit mask. The model keeps calling `write_kv` then `forward` with ONE
layout per step: a `SchemeLayout` carries the plain `BatchLayout` (for writing new K/V) and the
layout its scheme attends with, which any backend's `forward` dispatches on.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from workers.attention import get_backend
from workers.attention.base import (
    Attention,
    AttentionBackend,
    AttentionLayout,
    KernelLayout,
    StepLayout,
    kernel_layout,
)
from workers.attention.cascade import (
    CascadeLayout,
    build_cascade_layout,
    find_prefix_groups,
)
from workers.attention.custom_mask import (
    CustomMaskLayout,
    custom_mask_from_multi_item,
)
from workers.attention.layout import BatchLayout, build_layout
from workers.attention.multi_item import (
    MultiItemLayout,
    build_multi_item_layout,
)

SCHEMES = ("naive", "split", "ragged", "cascade", "multi_item", "custom_mask")


@dataclass(frozen=True)
class SchemeLayout:
    """One step's layout: `batch` for `write_kv` and plain attention, plus its scheme's extras."""

    scheme: str
    batch: BatchLayout
    cascade: CascadeLayout | None = None
    multi_item: MultiItemLayout | None = None
    custom: CustomMaskLayout | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown scheme {self.scheme!r}; known: {SCHEMES}")
        extras = {
            "cascade": self.cascade,
            "multi_item": self.multi_item,
            "custom_mask": self.custom,
        }
        for scheme, extra in extras.items():
            if (extra is not None) != (scheme == self.scheme):
                raise ValueError(f"a {self.scheme!r} layout must carry exactly its own extras")

    @property
    def attention(self) -> KernelLayout:
        """The layout the scheme attends with: its extras, or `batch` for the plain schemes."""
        return self.cascade or self.multi_item or self.custom or self.batch


def build_scheme_layout(
    scheme: str,
    qo_lens: Sequence[int],
    kv_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    page_size: int,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    shared_num_pages: Sequence[int] | None = None,
    prefix_lens: Sequence[int] | None = None,
    device: torch.device | str = "cpu",
) -> SchemeLayout:
    """Everything one step of `scheme` needs, for requests as in `build_layout`.

    cascade: `groups` + `shared_num_pages`, or neither (then `find_prefix_groups` decides).
    multi_item / custom_mask: `groups` + `prefix_lens` (tokens) are required. Raises ValueError
    on missing or inconsistent arguments.
    """
    batch = build_layout(qo_lens, kv_lens, block_tables, page_size, device=device)
    if scheme == "cascade":
        if groups is None and shared_num_pages is None:
            groups, shared_num_pages = find_prefix_groups(qo_lens, kv_lens, block_tables, page_size)
        if groups is None or shared_num_pages is None:
            raise ValueError("cascade needs both groups and shared_num_pages, or neither")
        cascade = build_cascade_layout(
            qo_lens, kv_lens, block_tables, page_size, groups, shared_num_pages, device
        )
        return SchemeLayout(scheme, batch, cascade=cascade)
    if scheme in ("multi_item", "custom_mask"):
        if groups is None or prefix_lens is None:
            raise ValueError(f"{scheme} needs groups and prefix_lens")
        mi = build_multi_item_layout(
            qo_lens, kv_lens, block_tables, page_size, groups, prefix_lens, device
        )
        if scheme == "multi_item":
            return SchemeLayout(scheme, batch, multi_item=mi)
        return SchemeLayout(scheme, batch, custom=custom_mask_from_multi_item(mi))
    return SchemeLayout(scheme, batch)


class SchemeBackend(AttentionBackend):
    """Runs every scheme on a plain backend, with a second instance for cascade's shared level.

    Plain, multi-item and custom-mask attention go to `inner` (its kernels, or the interface's
    torch defaults); cascade runs its unique level on `inner` and its shared level on `shared`
    (default: `inner`), so that each level keeps its plan cached across layers.
    """

    name = "schemes"

    def __init__(self, inner: AttentionBackend, shared: AttentionBackend | None = None) -> None:
        self.inner = inner
        self.shared = shared or inner

    def plan(self, layout: AttentionLayout) -> None:
        kind = kernel_layout(layout)
        if not isinstance(kind, CascadeLayout):
            self.inner.plan(kind)
            return
        self.inner.plan(kind.unique)
        if kind.shared is not None:
            self.shared.plan(kind.shared)

    def write_kv(
        self,
        kv_cache: torch.Tensor,
        layout: BatchLayout | StepLayout,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        self.inner.write_kv(kv_cache, layout, k, v)

    def _forward_inner(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        layout: BatchLayout | MultiItemLayout | CustomMaskLayout,
        *,
        sm_scale: float,
        return_lse: bool,
    ) -> Attention:
        return self.inner.forward(q, kv_cache, layout, sm_scale=sm_scale, return_lse=return_lse)

    # Every kind but cascade is the inner backend's own; cascade is the interface's two levels,
    # the unique one through `_forward_paged` (so on `inner`), the shared one on `shared`.
    _forward_paged = _forward_multi_item = _forward_custom_mask = _forward_inner

    def _shared_level(self) -> AttentionBackend:
        return self.shared


def make_scheme_backend(inner: str = "torch") -> SchemeBackend:
    """A `SchemeBackend` over two fresh instances of the registered backend `inner`."""
    return SchemeBackend(get_backend(inner), get_backend(inner))


# ---------------------------------------------------------------------------------------------
# Choosing a scheme


@dataclass(frozen=True)
class BatchShape:
    """The shape of a step whose requests share a prefix: `num_requests` x (prefix + suffix)."""

    prefix_len: int
    suffix_len: int
    num_requests: int
    backend: str = "torch"
    decode: bool = False


@dataclass(frozen=True)
class CostCell:
    """Measured milliseconds per scheme for one benchmark cell."""

    shape: BatchShape
    ms: Mapping[str, float]

    @property
    def fastest(self) -> str:
        return min(self.ms, key=lambda s: self.ms[s])


@dataclass(frozen=True)
class SchemeCosts:
    """A table of measured cells; a shape takes the fastest scheme of its nearest cell.

    Built from the records the benchmarks write (`cachesvc/bench/prefill_schemes.py`,
    `decode_cascade.py`): `SchemeCosts.from_records(json.loads(text))`.
    """

    cells: tuple[CostCell, ...]

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, Any]]) -> SchemeCosts:
        """Cells from dicts with `P`, `S`, `M`, `backend`, `ms` and optionally `decode`."""
        cells = []
        for r in records:
            shape = BatchShape(
                int(r["P"]), int(r["S"]), int(r["M"]), str(r["backend"]), bool(r.get("decode"))
            )
            cells.append(CostCell(shape, {str(k): float(v) for k, v in r["ms"].items()}))
        return cls(tuple(cells))

    def nearest(self, shape: BatchShape) -> CostCell | None:
        """The cell of the same backend and phase closest in log P, log S, log M; None if none."""
        same = [
            c
            for c in self.cells
            if c.shape.backend == shape.backend and c.shape.decode == shape.decode
        ]
        if not same:
            return None

        def distance(c: CostCell) -> float:
            pairs = (
                (c.shape.prefix_len, shape.prefix_len),
                (c.shape.suffix_len, shape.suffix_len),
                (c.shape.num_requests, shape.num_requests),
            )
            return sum((math.log2(a + 1) - math.log2(b + 1)) ** 2 for a, b in pairs)

        return min(same, key=distance)

    def estimate(self, shape: BatchShape) -> dict[str, float] | None:
        """Each scheme's ms at `shape`, from the cells of the same backend and phase.

        When those cells form a full P x S x M grid timing the same schemes, each scheme's log
        ms is interpolated multilinearly in log P, log S, log M (clamped to the grid: no
        extrapolation), so a shape between cells weighs both sides rather than taking the
        nearest one's ranking, which flips on a near tie. Otherwise the nearest cell's ms; None
        when there is no cell.
        """
        same = [
            c
            for c in self.cells
            if c.shape.backend == shape.backend and c.shape.decode == shape.decode
        ]
        grid = {(c.shape.prefix_len, c.shape.suffix_len, c.shape.num_requests): c.ms for c in same}
        axes = [sorted({key[i] for key in grid}) for i in range(3)]
        schemes = {frozenset(ms) for ms in grid.values()}
        if len(grid) != len(same) or len(grid) != math.prod(map(len, axes)) or len(schemes) != 1:
            cell = self.nearest(shape)
            return None if cell is None else dict(cell.ms)
        point = (shape.prefix_len, shape.suffix_len, shape.num_requests)
        weights = [_axis_weights(axis, x) for axis, x in zip(axes, point, strict=True)]
        log_ms = dict.fromkeys(next(iter(schemes)), 0.0)
        for (p, wp), (s, ws), (m, wm) in itertools.product(*weights):
            for scheme, ms in grid[(p, s, m)].items():
                log_ms[scheme] += wp * ws * wm * math.log(max(ms, 1e-9))
        return {scheme: math.exp(v) for scheme, v in log_ms.items()}


def _axis_weights(levels: Sequence[int], x: int) -> list[tuple[int, float]]:
    """The two levels around `x` with their linear weights in log2(x + 1), clamped to the ends."""
    if x <= levels[0] or len(levels) == 1:
        return [(levels[0], 1.0)]
    if x >= levels[-1]:
        return [(levels[-1], 1.0)]
    hi = next(i for i, level in enumerate(levels) if level >= x)
    lo_x, hi_x = math.log2(levels[hi - 1] + 1), math.log2(levels[hi] + 1)
    t = (math.log2(x + 1) - lo_x) / (hi_x - lo_x)
    return [(levels[hi - 1], 1.0 - t), (levels[hi], t)]


def choose_scheme(shape: BatchShape, costs: SchemeCosts | None = None) -> str:
    """The scheme to run a step of this shape with.

    With `costs`, the scheme `SchemeCosts.estimate` finds cheapest from the measured cells of
    the same backend and phase (a worker's start-up calibration, `scheme_calibration`);
    otherwise (or when no such cell exists) the built-in rules: the seed's FlashInfer
    measurements for GPU backends, ours for the CPU torch backend. Decode returns "cascade" or
    "ragged" (plain paged attention over shared prefix pages).
    """
    if shape.num_requests < 2 or shape.prefix_len == 0:
        return "ragged" if shape.decode else "naive"
    estimates = costs.estimate(shape) if costs is not None else None
    if estimates:
        return min(estimates, key=lambda k: estimates[k])
    rule = _torch_rule if shape.backend == "torch" else _gpu_rule
    return rule(shape)


def _gpu_rule(shape: BatchShape) -> str:
    """The seed's FlashInfer H-class measurements (§5.2, §5.3, §7.2)."""
    p, s, m = shape.prefix_len, shape.suffix_len, shape.num_requests
    if shape.decode:
        # Cascade decode pays its extra launches and merge back from about a 1K prefix on.
        return "cascade" if p >= 1024 else "ragged"
    if p >= 1024 and s <= 16 and m >= 8:
        # Long prefix, many short suffixes: one pass over the prefix for all suffix queries.
        return "multi_item"
    if p < 1024 and s >= 64 and m <= 4:
        # Few requests, short prefix, long suffixes: nothing to gain, launches and masks cost.
        return "naive"
    return "ragged"


# The CPU torch backend's costs, measured on the 2-core build machine (float32, heads 16/8,
# head_dim 128, page 16; single runs on a shared machine): attention there is ATen's
# flash kernel under a dense bias mask, so a causal or multi-item mask still pays for every
# q.k entry, and each prefill request is a separate call that first copies its pages.
_NS_PER_SCORE = 60.0  # one q.k entry, all 16 heads (55-95 ns from 1024^2 down to 64^2)
_NS_PER_CALL = 200_000.0  # one attend call with its page-table gather and bias set-up
_NS_PER_KV_TOKEN = 1_000.0  # copying one token's K and V (8 KB) out of the pages
_NS_PER_MERGED_ROW = 8_000.0  # merge_state of one query row (2-16 us, growing with rows)


# Cascade decode's extra call and merge cost more than the page copies it saves until it saves
# about this many prefix-token reads, (N - 1) * P. Below ~1K the two were within noise of each
# other (P 64-1024, N 2-8, either 10-30% ahead from run to run); from ~1.5K on cascade won every
# run (2x at 1792, 2.5-10x for P >= 1024, N >= 8), as the batch copies outgrow the caches.
_CASCADE_DECODE_MIN_SAVED_TOKENS = 1024


def _cost_ms(scores: int, calls: int, kv: int, merged: int = 0) -> float:
    ns = (
        scores * _NS_PER_SCORE
        + calls * _NS_PER_CALL
        + kv * _NS_PER_KV_TOKEN
        + merged * _NS_PER_MERGED_ROW
    )
    return ns / 1e6


def torch_prefill_estimates(shape: BatchShape) -> dict[str, float]:
    """Estimated ms per prefill scheme on the CPU torch backend (the model behind its rules).

    split costs ragged's work plus a step, custom_mask multi_item's plus a mask: neither is
    listed. Fitted to runs of cachesvc/bench/prefill_schemes.py and of the primitives.
    """
    p, s, m = shape.prefix_len, shape.suffix_len, shape.num_requests
    full = p + s
    return {
        "naive": _cost_ms(scores=m * full * full, calls=m, kv=m * full),
        "ragged": _cost_ms(scores=full * full + (m - 1) * s * full, calls=m, kv=m * full),
        "cascade": _cost_ms(
            scores=p * p + m * s * p + m * s * s, calls=m + 2, kv=2 * p + m * s, merged=m * s
        ),
        "multi_item": _cost_ms(scores=(p + m * s) ** 2, calls=1, kv=p + m * s),
    }


def _torch_rule(shape: BatchShape) -> str:
    """Our CPU measurements: plain decode where the paged-decode kernel reads pages in place,
    else a saved-reads threshold; a cost model for prefill."""
    if shape.decode:
        from workers.attention.paged_decode import load as paged_decode_built

        if paged_decode_built():
            # In place, each request's pages are read where they lie; cascade's shared level
            # copies the prefix's pages out, runs a second call and merges. It measured
            # 0.24-0.72x plain decode's speed on the quick grid of `cachesvc bench
            # decode-cascade` (docs/benchmarks/decode.md), and slower decode steps of the
            # engine for 2, 4 and 16 requests over a 1,000-token shared prefix.
            return "ragged"
        saved = (shape.num_requests - 1) * shape.prefix_len
        return "cascade" if saved >= _CASCADE_DECODE_MIN_SAVED_TOKENS else "ragged"
    estimates = torch_prefill_estimates(shape)
    return min(estimates, key=lambda k: estimates[k])
