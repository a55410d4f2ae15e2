"""The cache-control bench's plan and verdicts: the sizes make its scenarios mean what they
claim (a flood overruns the pool, alice's set fits), and the usage check catches a bad split."""

from __future__ import annotations

import pytest

from cachesvc.workloads.cache_control import (
    ALONE,
    BLOCK_SIZE,
    NO_QUOTAS,
    CacheControlResults,
    CacheControlShape,
    QuotaResult,
    RetentionResult,
    UsageCheck,
    flood_prompts,
    format_results,
    num_flood_prompts,
    random_prompt,
)


@pytest.mark.parametrize("quick", [False, True])
def test_the_sizes_overrun_the_pool_where_they_must(quick: bool) -> None:
    shape = CacheControlShape(quick)
    # The retained prefix fits beside a flood prompt; the flood is ten pools.
    assert shape.prefix_tokens + shape.flood_prompt_tokens <= shape.pool_tokens
    assert num_flood_prompts(shape) * shape.flood_prompt_tokens >= 10 * shape.pool_tokens
    # Alice's set fits the pool, but between two uses of one of her prompts bob sends more
    # than the rest of the pool holds: LRU alone loses her set.
    assert shape.working_set * shape.working_prompt_tokens <= shape.pool_tokens // 2
    between = shape.working_set * shape.floods_per_request * shape.flood_prompt_tokens
    assert between >= shape.pool_tokens
    assert shape.num_blocks * BLOCK_SIZE == shape.pool_tokens


def test_prompts_are_fixed_by_their_seed_and_distinct() -> None:
    assert random_prompt(5, 40, 1000) == random_prompt(5, 40, 1000)
    floods = flood_prompts(CacheControlShape(True), 49152, seed=7, count=20)
    assert len({tuple(p[:BLOCK_SIZE]) for p in floods}) == 20  # no shared first block
    assert all(100 <= t < 49152 for p in floods for t in p)


@pytest.mark.parametrize(
    ("prompt", "read", "written", "ok"),
    [
        (100, 64, 32, True),  # 4 uncached: the partial block
        (96, 0, 96, True),
        (100, 96, 16, False),  # more than the prompt
        (100, 0, 64, False),  # 36 uncached: more than one block went unaccounted
    ],
)
def test_usage_check(prompt: int, read: int, written: int, ok: bool) -> None:
    assert UsageCheck(prompt, read, written).adds_up is ok


def test_results_print_the_verdicts() -> None:
    results = CacheControlResults(
        retention=[RetentionResult("retained", 1024, 20480, 900.0, 100.0, 110.0, 1024, 1024)],
        quotas=[QuotaResult(ALONE, 1000, 900, 0), QuotaResult(NO_QUOTAS, 1000, 90, 5000)],
        usage=[UsageCheck(100, 64, 32), UsageCheck(100, 0, 64)],
    )
    text = format_results(results)
    assert "| hit" in text.replace("  ", " ") or " hit " in text
    assert "1.10x" in text  # after / warm
    assert "0.10x" in text  # no quotas vs alone
    assert "usage: 1 of 2 answers add up" in text
    assert not RetentionResult("x", 1024, 1, 1.0, 1.0, 1.0, 1008, 0).hit
