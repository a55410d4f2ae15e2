"""Every scheme, on both backends, against dense attention written here from first principles.

A step gives each request `qo_len` new tokens at the end of its `kv_len`-token sequence, whose
token at position x sits in page `table[x // page_size]`, slot `x % page_size`. Whatever the
scheme (plain pages, cascade levels, multi-item scoring, a packed mask), attention must equal
plain softmax attention in which the token at position p sees positions 0..p of its own sequence.
`dense_attention` computes exactly that and nothing else: it knows no logical batch, item
position, packed bit or cascade level. The FlashInfer backend runs over `fake_flashinfer`
(FlashInfer's documented rules), so a wrong causal alignment, bit order, mask offset, item
position or head mapping in what the backend hands FlashInfer fails here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from cachesvc.bench.gpu_check.correctness import Case, Shapes, attention, make_check_case
from cachesvc.bench.gpu_check.correctness import scheme_steps as steps_of
from workers.attention.flashinfer_backend import FlashInferBackend
from workers.attention.schemes import SchemeBackend, make_scheme_backend

CPU = Shapes(torch.float16, 4, 2, 16, page_size=4)
SM_SCALE = 0.3  # not FlashInfer's default 1/sqrt(head_dim) = 0.25: a dropped scale shows
# (P, S, M): whole shared pages, a partial prefix page, a prefix shorter than two pages.
CASES = [(8, 3, 2), (10, 5, 5), (5, 7, 3)]
SCHEMES = {"naive", "split", "ragged", "cascade", "multi_item", "custom_mask", "cascade_decode"}


def dense_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    qo_lens: list[int],
    kv_lens: list[int],
    tables: list[list[int]],
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, base-2 LSE) of every request's new tokens over its own sequence, in float64."""
    page_size, group = kv_cache.shape[2], q.shape[1] // kv_cache.shape[3]
    outs, lses, row = [], [], 0
    for qo_len, kv_len, table in zip(qo_lens, kv_lens, tables, strict=True):
        kv = torch.stack([kv_cache[table[x // page_size], :, x % page_size] for x in range(kv_len)])
        keys, values = kv[:, 0].double(), kv[:, 1].double()  # [kv_len, Hk, D]
        query_pos = torch.arange(kv_len - qo_len, kv_len)
        visible = torch.arange(kv_len)[None, :] <= query_pos[:, None]
        out = torch.empty(qo_len, q.shape[1], q.shape[2], dtype=torch.float64)
        lse = torch.empty(qo_len, q.shape[1], dtype=torch.float64)
        for h in range(q.shape[1]):
            kv_head = h // group  # GQA: a group of query heads shares one KV head
            scores = q[row : row + qo_len, h].double() @ keys[:, kv_head].T * sm_scale
            scores = scores.masked_fill(~visible, -math.inf)
            out[:, h] = torch.softmax(scores, dim=-1) @ values[:, kv_head]
            lse[:, h] = torch.logsumexp(scores, dim=-1) / math.log(2.0)
        outs.append(out)
        lses.append(lse)
        row += qo_len
    return torch.cat(outs), torch.cat(lses)


def check_against_dense(
    backend: SchemeBackend | FlashInferBackend,
    case: Case,
    name: str,
    *,
    atol: float,
    float32: bool = False,
) -> None:
    """Step `name` of `case` through `backend` equals `dense_attention` on the same inputs."""
    step = steps_of(case)[name]
    q, cache = (case.q.float(), case.kv_cache.float()) if float32 else (case.q, case.kv_cache)
    out, lse = attention(backend, q, cache, step, case, SM_SCALE)
    want_out, want_lse = dense_attention(q, cache, step[1], step[2], case.tables, SM_SCALE)
    torch.testing.assert_close(out.double(), want_out, atol=atol, rtol=atol, msg=name)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize(("p", "s", "m"), CASES)
def test_flashinfer_backend_runs_every_scheme_as_dense_attention(
    fake_fi: ModuleType, p: int, s: int, m: int
) -> None:
    case = make_check_case(p, s, m, CPU, "cpu")
    assert set(steps_of(case)) >= SCHEMES
    backend = SchemeBackend(FlashInferBackend(), FlashInferBackend())
    for name in steps_of(case):
        # fp16 inputs, float32 arithmetic in the fake: the output's fp16 rounding remains.
        check_against_dense(backend, case, name, atol=2e-3)


@pytest.mark.parametrize(("p", "s", "m"), CASES)
def test_torch_backend_runs_every_scheme_as_dense_attention(p: int, s: int, m: int) -> None:
    case = make_check_case(p, s, m, CPU, "cpu")
    backend = make_scheme_backend("torch")
    for name in steps_of(case):
        check_against_dense(backend, case, name, atol=1e-5, float32=True)


def test_one_wrapper_plans_custom_mask_then_multi_item_then_plain(
    install_flashinfer: Callable[..., ModuleType],
) -> None:
    """One paged wrapper planned for every mask kind in turn runs each right, even where plan()
    leaves the previous plan's mask buffers in place (as some FlashInfer versions do)."""
    fi = install_flashinfer(plan_resets_masks=False)
    case = make_check_case(10, 5, 5, CPU, "cpu")
    backend = FlashInferBackend()  # one instance: the cascade levels would take a second
    for name in ("custom_mask", "multi_item", "ragged", "custom_mask", "naive", "multi_item"):
        check_against_dense(backend, case, name, atol=2e-3)
    assert fi.BatchPrefillWithPagedKVCacheWrapper.instances == 1
