"""The torch backend and its ops against a dense float64 reference (research notes §10)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch

from workers.attention import get_backend
from workers.attention.layout import BatchLayout, build_layout
from workers.attention.ops import attend, attend_dense, attend_padded, causal_mask
from workers.attention.torch_backend import TorchBackend

HEAD_DIM = 16
Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request in float64: `q [M, Hq, D]`, `k`/`v [L, Hk, D]`, `visible [M, L]`."""
    group = q.shape[1] // k.shape[1]
    # Query head h reads KV head h // group.
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,lhd->hml", q.double(), k64) * sm_scale
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = torch.einsum("hml,lhd->mhd", probs, v64)
    return out, (lse / math.log(2.0)).T


def gather_request(
    cache: torch.Tensor, table: list[int], kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's keys and values, read page by page the obvious way."""
    k = torch.cat([cache[p, 0] for p in table])[:kv_len]
    v = torch.cat([cache[p, 1] for p in table])[:kv_len]
    return k, v


def batch_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    layout: BatchLayout,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    start = 0
    for table, qo_len, kv_len in zip(tables, layout.qo_lens, layout.kv_lens, strict=True):
        k, v = gather_request(cache, table, kv_len)
        visible = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if layout.causal:
            i = torch.arange(qo_len)[:, None]
            j = torch.arange(kv_len)[None]
            visible = j <= i + kv_len - qo_len
        out, lse = dense_reference(q[start : start + qo_len], k, v, visible, sm_scale)
        outs.append(out)
        lses.append(lse)
        start += qo_len
    return torch.cat(outs), torch.cat(lses)


def random_batch(
    rng: random.Random,
    qo_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    *,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, list[list[int]]]:
    """A random cache and shuffled block tables; with `share_prefix` the tables share full pages."""
    needed = [-(-n // page_size) for n in kv_lens]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = []
    for n in needed:
        tables.append(ids[:n])
        ids = ids[n:]
    if share_prefix and len(tables) > 1:
        shared = min((kv_lens[0] - 1) // page_size, needed[1] - 1)
        tables[1][:shared] = tables[0][:shared]  # only full pages of request 0 are shared
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    cache = torch.randn(num_blocks, 2, page_size, num_kv_heads, HEAD_DIM, generator=gen)
    return cache, tables


def check_batch(
    qo_lens: list[int],
    kv_lens: list[int],
    page_size: int,
    heads: tuple[int, int],
    causal: bool,
    seed: int,
) -> None:
    rng = random.Random(seed)
    num_qo_heads, num_kv_heads = heads
    cache, tables = random_batch(rng, qo_lens, kv_lens, page_size, num_kv_heads)
    layout = build_layout(qo_lens, kv_lens, tables, page_size, causal=causal)
    q = torch.randn(
        sum(qo_lens), num_qo_heads, HEAD_DIM, generator=torch.Generator().manual_seed(seed)
    )
    sm_scale = 1 / math.sqrt(HEAD_DIM)
    out, lse = TorchBackend().forward(q, cache, layout, sm_scale=sm_scale, return_lse=True)
    ref_out, ref_lse = batch_reference(q, cache, tables, layout, sm_scale)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_ragged_batch_matches_reference(
    heads: tuple[int, int], page_size: int, causal: bool
) -> None:
    rng = random.Random(page_size * 10 + heads[1])
    kv_lens = [rng.randint(page_size + 1, 70) for _ in range(4)]
    kv_lens[0] = 3 * page_size + 1  # a last page holding one token
    # qo_len spans a decode, a full prefill (qo_len == kv_len) and chunked prefills in between.
    qo_lens = [1, kv_lens[1], rng.randint(2, kv_lens[2]), rng.randint(1, kv_lens[3])]
    check_batch(qo_lens, kv_lens, page_size, heads, causal, seed=page_size)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed: int) -> None:
    rng = random.Random(1000 + seed)
    batch = rng.randint(1, 5)
    kv_lens = [rng.randint(1, 60) for _ in range(batch)]
    qo_lens = [rng.randint(0, n) for n in kv_lens]  # a request may bring no new token
    heads = rng.choice([(8, 2), (4, 4), (6, 3), (4, 1)])
    page_size = rng.choice([1, 4, 16])
    check_batch(qo_lens, kv_lens, page_size, heads, rng.random() < 0.5, seed)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_batch_matches_reference(page_size: int) -> None:
    # Lengths of 1, exactly full pages and partial pages all go through the padded decode path.
    kv_lens = [1, 16, 17, 48, 5, 33, 64, 2]
    check_batch([1] * len(kv_lens), kv_lens, page_size, (8, 2), True, seed=7)


def test_decodes_of_very_different_lengths_are_attended_in_groups() -> None:
    """A long request among short decodes (a handed-off prompt joining a decode batch) is not
    a padding length for all of them: the decodes split into groups of similar lengths, whose
    results are each request's own."""
    from workers.attention.torch_backend import _build_plan

    kv_lens = [9, 2049, 12, 30, 700, 10]
    tables = [[0] * -(-n // 4) for n in kv_lens]
    layout = build_layout([1] * len(kv_lens), kv_lens, tables, 4)
    groups = _build_plan(layout).decodes
    members = sorted(sorted(int(r) for r in g.rows) for g in groups)
    assert members == [[0, 2, 3, 5], [1], [4]]
    # Each group reads at most twice its shortest request's pages, or 8 pages more.
    for g in groups:
        pages = [-(-kv_lens[int(r)] // 4) for r in g.rows]
        assert g.gather.pages.shape[1] == max(pages) <= max(2 * min(pages), min(pages) + 8)
    check_batch([1] * len(kv_lens), kv_lens, 4, (8, 2), True, seed=11)


def test_write_kv_then_forward_round_trip() -> None:
    page_size, num_kv_heads = 4, 2
    cache = torch.zeros(8, 2, page_size, num_kv_heads, HEAD_DIM)
    tables = [[5, 2, 7], [0, 3]]
    kv_lens = [10, 6]
    layout = build_layout(kv_lens, kv_lens, tables, page_size)  # both requests fully new
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(16, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(16, num_kv_heads, HEAD_DIM, generator=gen)
    q = torch.randn(16, 8, HEAD_DIM, generator=gen)
    backend = TorchBackend()
    backend.write_kv(cache, layout, k, v)

    # Token 9 of request 0 is page 7, offset 1; token 5 of request 1 is page 3, offset 1.
    torch.testing.assert_close(cache[7, 0, 1], k[9])
    torch.testing.assert_close(cache[3, 1, 1], v[15])
    untouched = [(7, 2), (7, 3), (3, 2), (3, 3)] + [(p, o) for p in (1, 4, 6) for o in range(4)]
    for page, offset in untouched:
        assert not cache[page, :, offset].any()

    out = backend.forward(q, cache, layout, sm_scale=0.3)
    assert isinstance(out, torch.Tensor)
    for rows in (slice(0, 10), slice(10, 16)):
        n = rows.stop - rows.start
        ref, _ = dense_reference(q[rows], k[rows], v[rows], causal_mask(n, n), 0.3)
        torch.testing.assert_close(out[rows].double(), ref, atol=1e-5, rtol=1e-5)


def test_write_kv_casts_to_cache_dtype() -> None:
    cache = torch.zeros(2, 2, 4, 1, HEAD_DIM, dtype=torch.bfloat16)
    layout = build_layout([2], [3], [[1]], 4)
    k = torch.randn(2, 1, HEAD_DIM)
    TorchBackend().write_kv(cache, layout, k, -k)
    torch.testing.assert_close(cache[1, 0, 1:3].float(), k.bfloat16().float())
    torch.testing.assert_close(cache[1, 1, 1:3].float(), -k.bfloat16().float())


def test_plan_is_not_reused_for_another_layout() -> None:
    rng = random.Random(5)
    cache, tables = random_batch(rng, [3, 1], [9, 12], 4, 2, share_prefix=False)
    q = torch.randn(4, 4, HEAD_DIM)
    first = build_layout([3, 1], [9, 12], tables, 4)
    second = build_layout([1, 3], [9, 12], tables, 4)
    backend = TorchBackend()
    backend.plan(first)
    backend.forward(q, cache, first, sm_scale=0.25)
    out = backend.forward(q, cache, second, sm_scale=0.25)
    assert isinstance(out, torch.Tensor)
    ref, _ = batch_reference(q, cache, tables, second, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_attend_mask_combines_with_causal_and_empty_rows_are_zero() -> None:
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(5, 8, HEAD_DIM, generator=gen)
    k = torch.randn(9, 2, HEAD_DIM, generator=gen)
    v = torch.randn(9, 2, HEAD_DIM, generator=gen)
    mask = torch.rand(5, 9, generator=gen) < 0.6
    mask[2] = False  # a query that sees nothing
    mask[4, :] = False
    mask[4, 8] = True  # the newest key only: visible under the causal rule for the last query
    out, lse = attend(q, k, v, sm_scale=0.2, mask=mask, causal=True)
    visible = mask & causal_mask(5, 9)
    ref_out, ref_lse = dense_reference(q, k, v, visible, 0.2)
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out[2] == 0).all() and (lse[2] == float("-inf")).all()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", [attend_padded, attend_dense])
def test_padded_kernels_match_reference(kernel: Kernel) -> None:
    # attend_dense is the path for non-CPU devices; both must agree with the reference on CPU.
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 6, HEAD_DIM, generator=gen)
    k = torch.randn(3, 20, 2, HEAD_DIM, generator=gen)
    v = torch.randn(3, 20, 2, HEAD_DIM, generator=gen)
    visible = torch.rand(3, 4, 20, generator=gen) < 0.5
    visible[1, 3] = False
    out, lse = kernel(q, k, v, visible, 0.25)
    for b in range(3):
        ref_out, ref_lse = dense_reference(q[b], k[b], v[b], visible[b], 0.25)
        torch.testing.assert_close(out[b].double(), ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse[b].double(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
def test_half_dtypes_stay_close_to_float32(dtype: torch.dtype, tol: float) -> None:
    rng = random.Random(9)
    qo_lens, kv_lens = [1, 7, 1], [30, 20, 5]
    cache, tables = random_batch(rng, qo_lens, kv_lens, 4, 2)
    layout = build_layout(qo_lens, kv_lens, tables, 4)
    q = torch.randn(9, 8, HEAD_DIM)
    half_cache, half_q = cache.to(dtype), q.to(dtype)
    out, lse = TorchBackend().forward(half_q, half_cache, layout, sm_scale=0.25, return_lse=True)
    ref_out, ref_lse = batch_reference(half_q.float(), half_cache.float(), tables, layout, 0.25)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-2, rtol=1e-2)


def test_registry_gives_a_torch_backend() -> None:
    backend = get_backend("torch")
    assert isinstance(backend, TorchBackend) and backend.name == "torch"


def test_attend_over_no_keys_is_the_empty_state() -> None:
    out, lse = attend(
        torch.randn(3, 4, 8), torch.zeros(0, 2, 8), torch.zeros(0, 2, 8), sm_scale=1.0
    )
    assert out.shape == (3, 4, 8) and (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("head_dim", [HEAD_DIM, 64])  # 64: the CPU prefill kernel's path
def test_a_prompt_without_cached_tokens_attends_over_the_rows_just_written(head_dim: int) -> None:
    # A fresh prompt, one with a cached prefix, a decode; k and v are views into wider rows, as
    # the model's fused projection gives them.
    page_size, num_kv_heads, num_heads = 4, 2, 4
    qo_lens, kv_lens, tables = [10, 3, 1], [10, 9, 6], [[5, 2, 7], [0, 3, 4], [1, 6]]
    layout = build_layout(qo_lens, kv_lens, tables, page_size)
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(8, 2, page_size, num_kv_heads, head_dim, generator=gen)
    wide = torch.randn(14, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q = wide[:, :num_heads].contiguous()
    k, v = wide[:, num_heads : num_heads + 2], wide[:, num_heads + 2 :]
    backend = TorchBackend()
    gathers: list[object] = []
    read_pages = backend.read_pages
    backend.read_pages = lambda gather, kv: gathers.append(gather) or read_pages(gather, kv)  # type: ignore[method-assign]
    backend.write_kv(cache, layout, k, v)
    out = backend.forward(q, cache, layout, sm_scale=0.3)
    # The other backend never saw the write: it gathers every prefill's pages from the cache.
    gathered = TorchBackend().forward(q, cache, layout, sm_scale=0.3)
    assert isinstance(out, torch.Tensor) and isinstance(gathered, torch.Tensor)
    assert torch.equal(out, gathered)
    assert len(gathers) == 1  # the prompt with cached tokens only
    ref, _ = dense_reference(q[:10], k[:10], v[:10], causal_mask(10, 10), 0.3)
    torch.testing.assert_close(out[:10].double(), ref, atol=1e-5, rtol=1e-5)
