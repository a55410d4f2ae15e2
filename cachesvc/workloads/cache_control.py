"""What `cachesvc bench cache-control` sends, and how its results are judged and shown.

Two scenarios, each run in setups that differ only in the cache controls used, over one real
worker whose device pool is sized by `CacheControlShape` (no lower tiers: the device pool is
what retention and quotas defend):

* **retention**: tenant `alice` sends a long shared prefix (cold), then the same prefix with
  other questions (warm hits); tenant `bob` floods distinct prompts totalling
  `flood_factor` times the pool; then alice's prefix once more. Setups: without retention, and
  with alice's requests retained (`retention_s`). Judged: is the next use a hit, and its time
  to first token against the warm hits'.
* **quotas**: alice cycles through a small working set while bob floods distinct prompts
  between her requests, more than the pool holds between two uses of one of alice's prompts.
  Setups: alice alone, bob flooding without quotas, bob flooding with both tenants' share at
  one half. Judged: alice's hit ratio (cached ÷ prompt tokens) after her first round, against
  alice alone.

Every answer's usage must add up: read + written + uncached = prompt tokens, and (requests are
sent one at a time, so nothing else registers a block first) uncached is the partial last block
only, at most one block.

Prompts are random token ids from fixed seeds: no two share a block unless meant to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from cachesvc.workloads.table import format_table

BLOCK_SIZE = 16
TENANTS = ("alice", "bob")
RETENTION_S = 3600
QUESTION_LEN = 32
# Setups of each scenario, in the order they run.
NO_RETENTION, RETAINED = "no retention", "alice retained"
ALONE, NO_QUOTAS, QUOTAS = "alice alone", "bob floods, no quotas", "bob floods, quotas 1/2"
RETENTION_SETUPS = (NO_RETENTION, RETAINED)
QUOTA_SETUPS = (ALONE, NO_QUOTAS, QUOTAS)
QUOTA_SHARE = 0.5


@dataclass(frozen=True)
class CacheControlShape:
    """The bench's sizes; `quick` is a short run (a 1K prefix, a 2K-token pool)."""

    quick: bool = False

    @property
    def prefix_tokens(self) -> int:
        return 1024 if self.quick else 4096

    @property
    def pool_tokens(self) -> int:
        return 2 * self.prefix_tokens

    @property
    def num_blocks(self) -> int:
        return self.pool_tokens // BLOCK_SIZE

    @property
    def flood_factor(self) -> int:
        return 10

    @property
    def flood_prompt_tokens(self) -> int:
        return 512

    @property
    def warm_probes(self) -> int:
        return 3

    @property
    def working_set(self) -> int:
        """Alice's prompts in the quota scenario, each `working_prompt_tokens` long: a quarter
        of the pool in all."""
        return 4

    @property
    def working_prompt_tokens(self) -> int:
        return self.pool_tokens // (4 * self.working_set)

    @property
    def floods_per_request(self) -> int:
        """Bob's prompts between two of alice's: one cycle of alice's set sees a pool's worth."""
        return -(-self.pool_tokens // (self.working_set * self.flood_prompt_tokens))

    @property
    def rounds(self) -> int:
        return 2 if self.quick else 3


def random_prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    """`length` random token ids (drawn from `seed`), clear of the lowest ids (special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def flood_prompts(
    shape: CacheControlShape, vocab_size: int, seed: int, count: int
) -> list[list[int]]:
    """`count` distinct prompts of `shape.flood_prompt_tokens` (bob's)."""
    return [
        random_prompt(seed * 1_000_003 + i, shape.flood_prompt_tokens, vocab_size)
        for i in range(count)
    ]


def num_flood_prompts(shape: CacheControlShape) -> int:
    """Bob's prompts in the retention scenario: `flood_factor` times the pool in all."""
    return -(-shape.flood_factor * shape.pool_tokens // shape.flood_prompt_tokens)


@dataclass(frozen=True)
class UsageCheck:
    """One answer's usage split, checked."""

    prompt_tokens: int
    read_tokens: int
    written_tokens: int

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.read_tokens - self.written_tokens

    @property
    def adds_up(self) -> bool:
        return 0 <= self.uncached_tokens <= BLOCK_SIZE


@dataclass
class RetentionResult:
    """One retention setup: what the prefix's uses cost, and whether the last one hit."""

    setup: str
    prefix_tokens: int
    flood_tokens: int
    cold_ttft_ms: float
    warm_ttft_ms: float  # median of the warm probes
    after_ttft_ms: float
    after_cached_tokens: int
    retained_tokens: int

    @property
    def after_vs_warm(self) -> float:
        return self.after_ttft_ms / self.warm_ttft_ms

    @property
    def hit(self) -> bool:
        """The use after the flood read the whole prefix's full blocks from the cache."""
        return self.after_cached_tokens >= self.prefix_tokens // BLOCK_SIZE * BLOCK_SIZE


@dataclass
class QuotaResult:
    """One quota setup: alice's hit ratio after her first round."""

    setup: str
    prompt_tokens: int
    cached_tokens: int
    bob_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class CacheControlResults:
    retention: list[RetentionResult] = field(default_factory=list)
    quotas: list[QuotaResult] = field(default_factory=list)
    usage: list[UsageCheck] = field(default_factory=list)

    @property
    def usage_failures(self) -> int:
        return sum(not u.adds_up for u in self.usage)


def format_results(results: CacheControlResults) -> str:
    """The two tables and the usage line, as the bench prints them."""
    rows = [
        [
            r.setup,
            r.prefix_tokens,
            r.flood_tokens,
            round(r.cold_ttft_ms),
            round(r.warm_ttft_ms),
            round(r.after_ttft_ms),
            r.after_cached_tokens,
            "hit" if r.hit else "miss",
            f"{r.after_vs_warm:.2f}x",
        ]
        for r in results.retention
    ]
    heads = [
        "setup",
        "prefix",
        "flood tokens",
        "cold TTFT ms",
        "warm TTFT ms",
        "after-flood TTFT ms",
        "cached after",
        "after flood",
        "after / warm",
    ]
    out = ["retention: alice's prefix, bob's flood of distinct prompts", format_table(heads, rows)]
    alone = next((q for q in results.quotas if q.setup == ALONE), None)
    rows = [
        [
            q.setup,
            q.prompt_tokens,
            q.cached_tokens,
            f"{q.hit_ratio:.3f}",
            "-"
            if alone is None or not alone.hit_ratio
            else f"{q.hit_ratio / alone.hit_ratio:.2f}x",
            q.bob_tokens,
        ]
        for q in results.quotas
    ]
    heads = ["setup", "alice prompt tokens", "alice cached", "hit ratio", "vs alone", "bob tokens"]
    out += ["", "quotas: alice's working set, bob's flood", format_table(heads, rows)]
    n = len(results.usage)
    out += [
        "",
        f"usage: {n - results.usage_failures} of {n} answers add up "
        "(read + written + uncached = prompt, uncached <= 1 block)",
    ]
    return "\n".join(out)
