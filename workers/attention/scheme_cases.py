"""One shared-prefix prefill case, and the steps each scheme runs it with (attention only).

M requests `[prefix P | suffix S_m]` share P. The schemes at kernel level, as in the seed: naive =
M requests of P+S tokens; split = request 0's P+S in one step, then the other M-1 suffixes
against the cached prefix pages in a later step; ragged = rows `[P+S_0, S_1 .. S_{M-1}]` over
block tables sharing the prefix pages; cascade = causal prefill of P, then two-level attention
of the suffixes plus merge; multi_item = one logical request under the kMultiItemScoring mask;
custom_mask = the same with a packed mask. The prefill-schemes benchmark times these, and the
worker's start-up calibration (`scheme_calibration`) measures the same steps on its backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from workers.attention.schemes import (
    SchemeBackend,
    SchemeLayout,
    build_scheme_layout,
    make_scheme_backend,
)


class CaseShape(Protocol):
    """What a case is built for: the attention heads, the page size and where tensors live."""

    @property
    def num_qo_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class SharedPrefixCase:
    """Random queries and a filled paged cache for M requests `[prefix | suffix_m]`.

    The prefix's full pages are shared (ids `0..P//page-1`); each request owns the pages after
    them, which hold the prefix's partial last page (same K/V in every copy) and its suffix.
    """

    prefix_len: int
    suffix_len: int
    num_requests: int
    page_size: int
    kv_cache: torch.Tensor  # [num_blocks, 2, page_size, Hk, D]
    tables: list[list[int]]
    q_prefix: torch.Tensor  # [P, Hq, D]
    q_suffix: torch.Tensor  # [M, S, Hq, D]


def make_case(p: int, s: int, m: int, shape: CaseShape, seed: int = 0) -> SharedPrefixCase:
    """Random q/k/v (standard normal) for one grid cell, on `shape.device` in `shape.dtype`."""
    gen = torch.Generator().manual_seed(seed)
    ps, hk, d = shape.page_size, shape.num_kv_heads, shape.head_dim
    shared = p // ps
    own = -(-(p - shared * ps + s) // ps)
    tables = [list(range(shared)) + [shared + r * own + i for i in range(own)] for r in range(m)]
    kv_cache = torch.zeros(shared + m * own, 2, ps, hk, d)
    prefix_kv = torch.randn(p, 2, hk, d, generator=gen)
    for table in tables:
        kv = torch.cat([prefix_kv, torch.randn(s, 2, hk, d, generator=gen)])
        pages = torch.tensor(table)[torch.arange(p + s) // ps]
        kv_cache[pages, :, torch.arange(p + s) % ps] = kv
    q_prefix = torch.randn(p, shape.num_qo_heads, d, generator=gen)
    q_suffix = torch.randn(m, s, shape.num_qo_heads, d, generator=gen)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=shape.device, dtype=shape.dtype)

    return SharedPrefixCase(p, s, m, ps, put(kv_cache), tables, put(q_prefix), put(q_suffix))


@dataclass(frozen=True)
class Step:
    """One forward pass: its queries, its layout and the backend instance that plans it."""

    backend: SchemeBackend
    q: torch.Tensor
    layout: SchemeLayout


@dataclass(frozen=True)
class SchemeRun:
    """A scheme's steps, and how to pull the suffix rows `[M * S, Hq, D]` from their outputs."""

    steps: list[Step]
    suffix_rows: Callable[[list[torch.Tensor]], torch.Tensor]


def scheme_run(scheme: str, case: SharedPrefixCase, backend: str) -> SchemeRun:
    """The steps of `scheme` for `case`; every step gets its own backend so its plan persists."""
    p, s, m, ps = case.prefix_len, case.suffix_len, case.num_requests, case.page_size
    device = case.kv_cache.device
    suffixes = case.q_suffix.flatten(0, 1)

    def step(
        q: torch.Tensor, name: str, qo: list[int], kv: list[int], tables: Any, **kw: Any
    ) -> Step:
        layout = build_scheme_layout(name, qo, kv, tables, ps, device=device, **kw)
        return Step(make_scheme_backend(backend), q, layout)

    if scheme == "naive":
        q = torch.cat([torch.cat([case.q_prefix, case.q_suffix[r]]) for r in range(m)])
        only = step(q, "naive", [p + s] * m, [p + s] * m, case.tables)
        return SchemeRun([only], lambda outs: outs[0].unflatten(0, (m, p + s))[:, p:].flatten(0, 1))
    ragged_q = torch.cat([case.q_prefix, suffixes])
    ragged_lens = ([p + s] + [s] * (m - 1), [p + s] * m)
    if scheme == "split":
        first = step(ragged_q[: p + s], "split", [p + s], [p + s], case.tables[:1])
        rest = step(suffixes[s:], "split", [s] * (m - 1), [p + s] * (m - 1), case.tables[1:])
        return SchemeRun([first, rest], lambda outs: torch.cat([outs[0][p:], outs[1]]))
    if scheme == "cascade":
        prefix = step(case.q_prefix, "naive", [p], [p], case.tables[:1])
        groups = {"groups": [list(range(m))], "shared_num_pages": [p // ps]}
        suffix = step(suffixes, "cascade", [s] * m, [p + s] * m, case.tables, **groups)
        return SchemeRun([prefix, suffix], lambda outs: outs[1])
    extra: dict[str, Any] = {}
    if scheme in ("multi_item", "custom_mask"):
        extra = {"groups": [list(range(m))], "prefix_lens": [p]}
    only = step(ragged_q, scheme, *ragged_lens, case.tables, **extra)
    return SchemeRun([only], lambda outs: outs[0][p:])


def run_scheme(run: SchemeRun, kv_cache: torch.Tensor, sm_scale: float) -> list[torch.Tensor]:
    """Every step's attention output, in order."""
    outs = []
    for st in run.steps:
        out = st.backend.forward(st.q, kv_cache, st.layout, sm_scale=sm_scale)
        assert isinstance(out, torch.Tensor)
        outs.append(out)
    return outs
