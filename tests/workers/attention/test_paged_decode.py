"""The CPU paged-decode kernel: against a float64 reference and the gather path it replaces,
on the shapes the models use (GQA groups, head dims, page sizes, long requests split across
threads), and its build: cached once per machine, remembered when it fails."""

from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest
import torch

from workers.attention import paged_decode
from workers.attention.layout import BatchLayout, build_layout
from workers.attention.schemes import build_scheme_layout, make_scheme_backend
from workers.attention.torch_backend import TorchBackend, _build_plan

needs_kernel = pytest.mark.skipif(
    not paged_decode.load(), reason="no C++ compiler: the torch backend gathers pages instead"
)


def decode_case(
    kv_lens: list[int], page_size: int, heads: tuple[int, int], head_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], BatchLayout]:
    """One decode query per request over a random cache with shuffled (scattered) pages."""
    rng = random.Random(seed)
    needed = [-(-n // page_size) for n in kv_lens]
    ids = list(range(sum(needed) + 2))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in needed:
        tables.append(ids[start : start + n])
        start += n
    gen = torch.Generator().manual_seed(seed)
    num_qo_heads, num_kv_heads = heads
    cache = torch.randn(len(ids), 2, page_size, num_kv_heads, head_dim, generator=gen)
    q = torch.randn(len(kv_lens), num_qo_heads, head_dim, generator=gen)
    layout = build_layout([1] * len(kv_lens), kv_lens, tables, page_size)
    return q, cache, tables, layout


def reference(
    q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], kv_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each request's query over its keys, read page by page."""
    scale = q.shape[-1] ** -0.5
    group = q.shape[1] // cache.shape[3]
    outs, lses = [], []
    for b, (table, kv_len) in enumerate(zip(tables, kv_lens, strict=True)):
        k = torch.cat([cache[p, 0] for p in table])[:kv_len].double()
        v = torch.cat([cache[p, 1] for p in table])[:kv_len].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v))
        lses.append(torch.logsumexp(scores, dim=-1) / math.log(2.0))
    return torch.stack(outs), torch.stack(lses)


def forward(backend: TorchBackend, q: torch.Tensor, cache: torch.Tensor, layout: BatchLayout):
    result = backend.forward(q, cache, layout, sm_scale=q.shape[-1] ** -0.5, return_lse=True)
    assert isinstance(result, tuple)
    return result


@needs_kernel
@pytest.mark.parametrize(
    ("heads", "head_dim"),
    # The vector path's head dims (64, 128) with groups of 1-4 query heads a pass, and groups
    # past that (8 and 6: several passes); the portable path's (16, 24).
    [((9, 3), 64), ((8, 2), 128), ((8, 1), 64), ((12, 2), 128), ((4, 4), 16), ((6, 1), 24)],
)
# Pages of one token, of one 16-token chunk, and of chunks with a partial last one (40).
@pytest.mark.parametrize("page_size", [1, 16, 40])
def test_kernel_matches_reference_and_gather(
    heads: tuple[int, int], head_dim: int, page_size: int
) -> None:
    # A one-token request, full and partial last pages, and one long enough to be split.
    kv_lens = [1, 16, 17, 33, 5, 700]
    q, cache, tables, layout = decode_case(kv_lens, page_size, heads, head_dim, seed=head_dim)
    out, lse = forward(TorchBackend(), q, cache, layout)
    ref_out, ref_lse = reference(q, cache, tables, kv_lens)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    gathered = forward(TorchBackend(decode_in_place=False), q, cache, layout)
    torch.testing.assert_close(out, gathered[0], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_decode_reads_the_pages_in_place() -> None:
    """No gather table is built for a decode batch when the kernel runs: the pages are read
    where they lie (the gather path builds them on its first forward)."""
    q, cache, _, layout = decode_case([40, 300, 7], 16, (9, 3), 64, seed=1)
    backend = TorchBackend()
    backend.plan(layout)
    forward(backend, q, cache, layout)
    assert backend._plan_for(layout)._groups is None
    gather = TorchBackend(decode_in_place=False)
    forward(gather, q, cache, layout)
    assert gather._plan_for(layout)._groups is not None


@needs_kernel
def test_one_long_request_split_across_threads_merges_exactly() -> None:
    torch_threads = torch.get_num_threads()
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            q, cache, tables, layout = decode_case([4096], 16, (9, 3), 64, seed=threads)
            out, lse = forward(TorchBackend(), q, cache, layout)
            ref_out, ref_lse = reference(q, cache, tables, [4096])
            torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(torch_threads)


@needs_kernel
def test_query_rows_of_a_fused_projection_and_mixed_batches() -> None:
    """q as the model passes it (a strided view of the fused q/k/v rows), decodes mixed with a
    prefill: the kernel writes only its own rows."""
    page_size, heads, head_dim = 4, (4, 2), 16
    kv_lens, qo_lens = [10, 6, 21], [1, 6, 1]
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(12, 2, page_size, heads[1], head_dim, generator=gen)
    tables = [[3, 7, 1], [0, 5], [2, 4, 6, 8, 9, 10]]
    layout = build_layout(qo_lens, kv_lens, tables, page_size)
    fused = torch.randn(sum(qo_lens), heads[0] + 2 * heads[1], head_dim, generator=gen)
    q = fused[:, : heads[0]]
    assert not q.is_contiguous()
    out, lse = forward(TorchBackend(), q, cache, layout)
    ref_out, ref_lse = forward(TorchBackend(decode_in_place=False), q.contiguous(), cache, layout)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_bfloat16_cache_within_its_precision() -> None:
    q, cache, tables, layout = decode_case([50, 300], 16, (9, 3), 64, seed=3)
    out, _ = forward(TorchBackend(), q.bfloat16(), cache.bfloat16(), layout)
    ref_out, _ = reference(q.bfloat16().float(), cache.bfloat16().float(), tables, [50, 300])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)


@needs_kernel
def test_cascade_decode_with_the_kernel_equals_plain_decode() -> None:
    """Cascade's unique level (one row per request over its own pages) runs on the kernel; its
    merge with the shared level gives what plain decode over all pages gives."""
    page_size, n, shared_pages = 16, 3, 4
    own = 2
    tables = [
        list(range(shared_pages)) + [shared_pages + r * own + i for i in range(own)]
        for r in range(n)
    ]
    kv_lens = [(shared_pages + own) * page_size - r for r in range(n)]
    gen = torch.Generator().manual_seed(9)
    cache = torch.randn(shared_pages + n * own, 2, page_size, 3, 64, generator=gen)
    q = torch.randn(n, 9, 64, generator=gen)
    plain = build_scheme_layout("ragged", [1] * n, kv_lens, tables, page_size)
    cascade = build_scheme_layout(
        "cascade", [1] * n, kv_lens, tables, page_size,
        groups=[list(range(n))], shared_num_pages=[shared_pages],
    )  # fmt: skip
    backend = make_scheme_backend("torch")
    a = backend.forward(q, cache, plain, sm_scale=0.125)
    b = backend.forward(q, cache, cascade, sm_scale=0.125)
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize(("heads", "head_dim"), [((9, 3), 64), ((8, 2), 128), ((6, 1), 24)])
def test_several_queries_over_the_same_pages_in_place(
    heads: tuple[int, int], head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A non-causal layout with several queries a request (cascade's shared level) runs on the
    kernel, every query over all of its request's pages, with no gather; the same as the
    reference, split across threads or not."""
    page_size, qo_lens, kv_lens = 16, [5, 1, 3], [70, 33, 200]
    needed = [-(-n // page_size) for n in kv_lens]
    ids = list(range(sum(needed)))
    random.Random(4).shuffle(ids)
    tables = [ids[sum(needed[:b]) : sum(needed[: b + 1])] for b in range(len(kv_lens))]
    gen = torch.Generator().manual_seed(head_dim)
    cache = torch.randn(len(ids), 2, page_size, heads[1], head_dim, generator=gen)
    q = torch.randn(sum(qo_lens), heads[0], head_dim, generator=gen)
    layout = build_layout(qo_lens, kv_lens, tables, page_size, causal=False)
    monkeypatch.setattr(TorchBackend, "read_pages", lambda *_: pytest.fail("no gather"))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out, lse = forward(TorchBackend(), q, cache, layout)
            start = 0
            for b, (qo_len, table) in enumerate(zip(qo_lens, tables, strict=True)):
                rows = slice(start, start + qo_len)
                lens = [kv_lens[b]] * qo_len
                ref_out, ref_lse = reference(q[rows], cache, [table] * qo_len, lens)
                torch.testing.assert_close(out[rows].double(), ref_out, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(lse[rows].double(), ref_lse, atol=1e-5, rtol=1e-5)
                start += qo_len
    finally:
        torch.set_num_threads(before)


def test_gather_path_is_kept_without_the_kernel() -> None:
    """Where the kernel is off (no compiler, or asked for) decode still matches the reference."""
    kv_lens = [3, 40, 17]
    q, cache, tables, layout = decode_case(kv_lens, 16, (8, 2), 32, seed=2)
    out, lse = forward(TorchBackend(decode_in_place=False), q, cache, layout)
    ref_out, ref_lse = reference(q, cache, tables, kv_lens)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    assert _build_plan(layout).decode_table().tolist() == [[0, 0, 3], [1, 1, 40], [2, 4, 17]]


@needs_kernel
def test_a_new_process_loads_the_cached_library_without_building() -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.INFO);"
        "from workers.attention.paged_decode import load; assert load()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    assert "building" not in done.stderr
