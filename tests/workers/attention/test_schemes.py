"""The scheme backend driven as the engine drives it, and the automatic scheme choice."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from workers.attention.base import kernel_layout
from workers.attention.layout import build_layout
from workers.attention.schemes import (
    SCHEMES,
    BatchShape,
    SchemeBackend,
    SchemeCosts,
    SchemeLayout,
    build_scheme_layout,
    choose_scheme,
    make_scheme_backend,
)
from workers.attention.torch_backend import TorchBackend

HEAD_DIM = 16
SM_SCALE = 0.25


@dataclass(frozen=True)
class SharedPrefix:
    """Per-token q and k/v of a prefix and M suffixes (the model's projections, made up)."""

    page_size: int
    q_prefix: torch.Tensor  # [P, Hq, D]
    kv_prefix: torch.Tensor  # [P, 2, Hk, D]
    q_suffix: list[torch.Tensor]
    kv_suffix: list[torch.Tensor]

    @property
    def prefix_len(self) -> int:
        return self.q_prefix.shape[0]

    @property
    def suffix_lens(self) -> list[int]:
        return [q.shape[0] for q in self.q_suffix]

    def tables(self, share: bool) -> list[list[int]]:
        """Page tables with room for one more token; `share`: the prefix's full pages in common."""
        ps, p = self.page_size, self.prefix_len
        shared = p // ps if share else 0
        tables, next_page = [], shared
        for s in self.suffix_lens:
            own = -(-(p + s + 1) // ps) - shared
            tables.append(list(range(shared)) + list(range(next_page, next_page + own)))
            next_page += own
        return tables


def random_shared_prefix(seed: int, page_size: int, heads: tuple[int, int]) -> SharedPrefix:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hk = heads
    p = rng.randint(1, 3 * page_size + 5)
    suffix_lens = [rng.randint(1, page_size + 3) for _ in range(rng.randint(2, 4))]

    def q(n: int) -> torch.Tensor:
        return torch.randn(n, hq, HEAD_DIM, generator=gen)

    def kv(n: int) -> torch.Tensor:
        return torch.randn(n, 2, hk, HEAD_DIM, generator=gen)

    return SharedPrefix(
        page_size, q(p), kv(p), [q(s) for s in suffix_lens], [kv(s) for s in suffix_lens]
    )


def run_step(
    backend: SchemeBackend,
    cache: torch.Tensor,
    case: SharedPrefix,
    scheme: str,
    members: list[int],
    starts: list[int],
    tables: list[list[int]],
    **kw: object,
) -> list[torch.Tensor]:
    """One engine step: request m brings tokens `starts[m]..` of `[prefix | suffix_m]`.

    Writes their K/V, runs attention, returns each member's suffix output rows.
    """
    p = case.prefix_len
    pairs = list(zip(members, starts, strict=True))
    qs = [torch.cat([case.q_prefix[st:], case.q_suffix[m]]) for m, st in pairs]
    kvs = [torch.cat([case.kv_prefix[st:], case.kv_suffix[m]]) for m, st in pairs]
    qo_lens = [x.shape[0] for x in qs]
    kv_lens = [p + case.suffix_lens[m] for m in members]
    member_tables = [tables[m] for m in members]
    layout = build_scheme_layout(scheme, qo_lens, kv_lens, member_tables, case.page_size, **kw)
    kv = torch.cat(kvs)
    backend.write_kv(cache, layout, kv[:, 0], kv[:, 1])
    out = backend.forward(torch.cat(qs), cache, layout, sm_scale=SM_SCALE)
    assert isinstance(out, torch.Tensor)
    chunks = out.split(qo_lens)
    return [c[-case.suffix_lens[m] :] for c, m in zip(chunks, members, strict=True)]


def run_scheme(case: SharedPrefix, scheme: str, cache_pages: int) -> list[torch.Tensor]:
    """Every request's suffix outputs under `scheme`, in one step (two for split)."""
    p, m = case.prefix_len, len(case.suffix_lens)
    heads_kv = case.kv_prefix.shape[2]
    cache = torch.zeros(cache_pages, 2, case.page_size, heads_kv, HEAD_DIM)
    backend = make_scheme_backend()
    everyone = list(range(m))
    # A request that is not the first recomputes the prefix's partial last page, as in vLLM.
    tail_start = p - p % case.page_size
    if scheme == "naive":
        starts = [0] * m
        return run_step(backend, cache, case, scheme, everyone, starts, case.tables(False))
    tables = case.tables(True)
    if scheme == "split":
        first = run_step(backend, cache, case, scheme, [0], [0], tables)
        rest = run_step(backend, cache, case, scheme, everyone[1:], [tail_start] * (m - 1), tables)
        return first + rest
    if scheme in ("multi_item", "custom_mask"):
        groups = {"groups": [everyone], "prefix_lens": [p]}
        starts = [0] + [p] * (m - 1)
        return run_step(backend, cache, case, scheme, everyone, starts, tables, **groups)
    starts = [0] + [tail_start] * (m - 1)
    return run_step(backend, cache, case, scheme, everyone, starts, tables)


@pytest.mark.parametrize("heads", [(4, 2), (8, 2)])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("seed", range(3))
def test_every_scheme_equals_naive(seed: int, page_size: int, heads: tuple[int, int]) -> None:
    case = random_shared_prefix(seed, page_size, heads)
    pages = sum(len(t) for t in case.tables(False))
    want = run_scheme(case, "naive", pages)
    for scheme in SCHEMES[1:]:
        got = run_scheme(case, scheme, pages)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=scheme)


@pytest.mark.parametrize("page_size", [4, 16])
def test_cascade_decode_step_equals_plain_decode(page_size: int) -> None:
    case = random_shared_prefix(5, page_size, (8, 2))
    p, tables = case.prefix_len, case.tables(True)
    m = len(tables)
    cache = torch.randn(sum(len(t) for t in case.tables(False)), 2, page_size, 2, HEAD_DIM)
    kv_lens = [p + s + 1 for s in case.suffix_lens]
    plain = build_scheme_layout("ragged", [1] * m, kv_lens, tables, page_size)
    cascade = build_scheme_layout("cascade", [1] * m, kv_lens, tables, page_size)
    assert cascade.cascade is not None
    assert cascade.cascade.shared_num_pages == ((p // page_size,) if p >= page_size else (0,) * m)
    q = torch.randn(m, 8, HEAD_DIM)
    backend = make_scheme_backend()
    want = backend.forward(q, cache, plain, sm_scale=SM_SCALE, return_lse=True)
    got = backend.forward(q, cache, cascade, sm_scale=SM_SCALE, return_lse=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_plain_batch_layout_passes_through() -> None:
    layout = build_layout([3, 1], [5, 6], [[0, 1], [2, 3]], 4)
    cache = torch.randn(4, 2, 4, 2, HEAD_DIM)
    q = torch.randn(4, 4, HEAD_DIM)
    got = make_scheme_backend().forward(q, cache, layout, sm_scale=SM_SCALE)
    want = TorchBackend().forward(q, cache, layout, sm_scale=SM_SCALE)
    assert isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    assert torch.equal(got, want)


class _KernelBackend(TorchBackend):
    """A backend with its own multi-item kernel, as the FlashInfer backend has."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _forward_multi_item(self, q, kv_cache, layout, *, sm_scale, return_lse):
        self.calls += 1
        return torch.zeros_like(q)


def test_multi_item_uses_the_inner_backends_kernel_when_it_has_one() -> None:
    tables = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7]]
    layout = build_scheme_layout(
        "multi_item", [100, 4], [100, 100], tables, 16, groups=[[0, 1]], prefix_lens=[96]
    )
    inner = _KernelBackend()
    out = SchemeBackend(inner).forward(
        torch.ones(104, 2, HEAD_DIM), torch.zeros(8, 2, 16, 1, HEAD_DIM), layout, sm_scale=1.0
    )
    assert inner.calls == 1 and isinstance(out, torch.Tensor) and not out.any()


@pytest.mark.parametrize("scheme", ["ragged", "cascade", "multi_item", "custom_mask"])
def test_a_plain_backend_runs_a_step_layout_as_its_plain_batch(scheme: str) -> None:
    """The seed's example through one TorchBackend: `forward` unwraps the step's layout."""
    tables = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7]]
    qo_lens = [4, 4] if scheme == "cascade" else [100, 4]  # cascade finds its groups itself
    logical = scheme in ("multi_item", "custom_mask")
    items = {"groups": [[0, 1]], "prefix_lens": [96]} if logical else {}
    layout = build_scheme_layout(scheme, qo_lens, [100, 100], tables, 16, **items)
    extras = {
        "cascade": layout.cascade,
        "multi_item": layout.multi_item,
        "custom_mask": layout.custom,
    }
    assert kernel_layout(layout) is extras.get(scheme, layout.batch)
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(8, 2, 16, 2, HEAD_DIM, generator=gen)
    q = torch.randn(sum(qo_lens), 4, HEAD_DIM, generator=gen)
    backend = TorchBackend()
    for _ in range(2):  # a cascade's levels take turns on the one instance's plan
        got = backend.forward(q, cache, layout, sm_scale=SM_SCALE, return_lse=True)
        want = backend.forward(q, cache, layout.batch, sm_scale=SM_SCALE, return_lse=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_seed_worked_example_ragged_layout() -> None:
    tables = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7]]
    layout = build_scheme_layout("ragged", [100, 4], [100, 100], tables, 16)
    assert layout.batch.qo_indptr.tolist() == [0, 100, 104]
    assert layout.batch.kv_indptr.tolist() == [0, 7, 14]
    assert layout.batch.kv_indices.tolist() == tables[0] + tables[1]
    assert layout.batch.kv_last_page_len.tolist() == [4, 4]


def test_scheme_layout_validation() -> None:
    batch = build_layout([1], [1], [[0]], 4)
    with pytest.raises(ValueError, match="unknown scheme"):
        SchemeLayout("fast", batch)
    with pytest.raises(ValueError, match="extras"):
        SchemeLayout("cascade", batch)
    with pytest.raises(ValueError, match="needs groups and prefix_lens"):
        build_scheme_layout("multi_item", [1], [1], [[0]], 4)
    with pytest.raises(ValueError, match="or neither"):
        build_scheme_layout("cascade", [1], [1], [[0]], 4, groups=[[0]])


# The seed's FlashInfer table (§5.2, ms): the GPU rules must land within 10% of the best.
SEED_GPU_MS = {
    (96, 4, 2): {"naive": 0.037, "split": 0.049, "ragged": 0.036, "cascade": 0.114,
                 "multi_item": 0.038, "custom_mask": 0.048},
    (96, 4, 32): {"naive": 0.094, "split": 0.060, "ragged": 0.043, "cascade": 0.115,
                  "multi_item": 0.059, "custom_mask": 0.071},
    (96, 256, 2): {"naive": 0.086, "split": 0.137, "ragged": 0.113, "cascade": 0.163,
                   "multi_item": 0.131, "custom_mask": 0.159},
    (96, 256, 32): {"naive": 0.437, "split": 0.404, "ragged": 0.346, "cascade": 0.505,
                    "multi_item": 0.551, "custom_mask": 12.508},
    (8196, 4, 2): {"naive": 9.883, "split": 5.361, "ragged": 5.425, "cascade": 5.452,
                   "multi_item": 5.295, "custom_mask": 12.668},
    (8196, 4, 32): {"naive": 145.487, "split": 5.909, "ragged": 7.422, "cascade": 5.557,
                    "multi_item": 5.448, "custom_mask": 13.007},
    (8196, 256, 2): {"naive": 10.469, "split": 6.039, "ragged": 5.953, "cascade": 6.312,
                     "multi_item": 5.906, "custom_mask": 14.085},
    (8196, 256, 32): {"naive": 154.564, "split": 14.692, "ragged": 14.094, "cascade": 15.245,
                      "multi_item": 14.133, "custom_mask": 51.788},
}  # fmt: skip


@pytest.mark.parametrize("cell", sorted(SEED_GPU_MS))
def test_gpu_rules_within_ten_percent_of_the_seeds_best(cell: tuple[int, int, int]) -> None:
    ms = SEED_GPU_MS[cell]
    chosen = choose_scheme(BatchShape(*cell, backend="flashinfer"))
    assert ms[chosen] <= 1.1 * min(ms.values()), chosen


def test_costs_table_takes_the_nearest_cells_fastest() -> None:
    records = [
        {"P": p, "S": s, "M": m, "backend": "flashinfer", "ms": ms}
        for (p, s, m), ms in SEED_GPU_MS.items()
    ]
    records.append({"P": 1024, "S": 1, "M": 64, "backend": "x", "decode": True,
                    "ms": {"ragged": 2.0, "cascade": 1.0}})  # fmt: skip
    costs = SchemeCosts.from_records(records)
    for (p, s, m), ms in SEED_GPU_MS.items():
        shape = BatchShape(p, s, m, backend="flashinfer")
        assert choose_scheme(shape, costs) == min(ms, key=lambda k: ms[k])
    # Between cells: each scheme's cost interpolated in log space (P 6000 is near 8196).
    assert choose_scheme(BatchShape(6000, 8, 24, "flashinfer"), costs) == "multi_item"
    assert choose_scheme(BatchShape(128, 200, 3, "flashinfer"), costs) == "naive"
    # Decode cells only answer decode shapes; no cell of the backend: the built-in rules.
    assert choose_scheme(BatchShape(900, 1, 50, "x", decode=True), costs) == "cascade"
    assert choose_scheme(BatchShape(900, 1, 50, "x"), costs) == "ragged"


@pytest.mark.parametrize(
    ("shape", "want"),
    [
        (BatchShape(4096, 16, 1), "naive"),  # one request: nothing to share
        (BatchShape(0, 16, 8), "naive"),
        (BatchShape(0, 1, 8, decode=True), "ragged"),
        (BatchShape(32768, 1, 128, "flashinfer", decode=True), "cascade"),
        (BatchShape(512, 1, 128, "flashinfer", decode=True), "ragged"),
    ],
)
def test_choose_scheme_table(shape: BatchShape, want: str) -> None:
    assert choose_scheme(shape) == want


# Our CPU torch measurements (cachesvc/bench/prefill_schemes.py full grid, float32, 1 thread on
# the shared 2-core build machine, ms): the CPU rules must land within 10% of the best.
CPU_TORCH_MS = {
    (96, 4, 2): {"naive": 3.52, "split": 2.02, "ragged": 2.02, "cascade": 2.27,
                 "multi_item": 2.06, "custom_mask": 1.98},
    (96, 4, 32): {"naive": 78.91, "split": 14.91, "ragged": 11.09, "cascade": 8.66,
                  "multi_item": 6.68, "custom_mask": 6.52},
    (96, 128, 2): {"naive": 11.97, "split": 9.84, "ragged": 9.85, "cascade": 10.42,
                   "multi_item": 14.55, "custom_mask": 14.50},
    (96, 128, 32): {"naive": 352.09, "split": 198.65, "ragged": 208.97, "cascade": 397.68,
                    "multi_item": 2949.78, "custom_mask": 2933.07},
    (1028, 4, 2): {"naive": 347.07, "split": 177.47, "ragged": 171.29, "cascade": 170.43,
                   "multi_item": 173.17, "custom_mask": 183.11},
    (1028, 4, 32): {"naive": 5717.20, "split": 271.62, "ragged": 273.05, "cascade": 204.96,
                    "multi_item": 216.63, "custom_mask": 228.35},
    (1028, 128, 2): {"naive": 461.49, "split": 249.33, "ragged": 253.29, "cascade": 229.09,
                     "multi_item": 272.24, "custom_mask": 265.14},
    (1028, 128, 32): {"naive": 7046.23, "split": 1174.28, "ragged": 1188.37, "cascade": 1169.41,
                      "multi_item": 4671.70, "custom_mask": 4609.29},
}  # fmt: skip


@pytest.mark.parametrize("cell", sorted(CPU_TORCH_MS))
def test_cpu_rules_within_ten_percent_of_our_best(cell: tuple[int, int, int]) -> None:
    ms = CPU_TORCH_MS[cell]
    chosen = choose_scheme(BatchShape(*cell, backend="torch"))
    assert ms[chosen] <= 1.1 * min(ms.values()), chosen


@pytest.mark.parametrize(
    ("prefix_len", "num_requests", "want"),
    [
        (256, 8, "cascade"),  # the decode bench's grid, on the gather path: cascade 2.3-16x
        (4096, 64, "cascade"),
        (1024, 2, "cascade"),
        (512, 2, "ragged"),  # under ~1K saved prefix reads the two are within noise
        (128, 4, "ragged"),
        (64, 8, "ragged"),
    ],
)
def test_cpu_decode_rule_on_the_gather_path(
    prefix_len: int, num_requests: int, want: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.attention import paged_decode

    monkeypatch.setattr(paged_decode, "load", lambda: False)
    assert choose_scheme(BatchShape(prefix_len, 128, num_requests, decode=True)) == want


@pytest.mark.parametrize(("prefix_len", "num_requests"), [(256, 8), (4096, 64), (1024, 2)])
def test_cpu_decode_rule_with_the_in_place_kernel_is_plain_decode(
    prefix_len: int, num_requests: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reading each request's pages in place beat cascade's copied shared level at every cell
    # measured (docs/benchmarks/decode.md).
    from workers.attention import paged_decode

    monkeypatch.setattr(paged_decode, "load", lambda: True)
    assert choose_scheme(BatchShape(prefix_len, 128, num_requests, decode=True)) == "ragged"
