"""Multi-item scoring: one prefix, many items, one forward pass (FlashInfer's kMultiItemScoring).

The prefix and every item form one logical sequence `[prefix | item_0 | item_1 | ...]`; the
multi-item mask lets each item see the prefix and itself, never another item, and each item's
tokens take the positions they would have right after the prefix. So the log-probs equal
scoring `prefix + item` as its own request, while the prefix is computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cachesvc.kv.block_pool import BlockPool, NoFreeBlocksError
from cachesvc.kv.types import BlockId
from workers.attention.schemes import build_scheme_layout
from workers.engine.runner import ModelRunner
from workers.text.tokenizer import Tokenizer


class ScoreError(ValueError):
    """A scoring request the engine cannot serve; the message names the field."""


@dataclass(frozen=True)
class ScoreInput:
    prefix_ids: tuple[int, ...]
    items_ids: tuple[tuple[int, ...], ...]
    label_token_ids: tuple[int, ...]


def encode_input(
    tokenizer: Tokenizer | None,
    prefix: str | Sequence[int],
    items: Sequence[str | Sequence[int]],
    label_token_ids: Sequence[int],
) -> ScoreInput:
    """The ids of a scoring request given as text or ids: the prefix is encoded as a prompt
    (BOS where the model adds one), items as continuations of it. Raises ScoreError naming a
    field given as text to a model without a tokenizer; `validate` checks the rest."""

    def ids(text_or_ids: str | Sequence[int], field: str, special: bool = False) -> list[int]:
        if not isinstance(text_or_ids, str):
            return [int(t) for t in text_or_ids]
        if tokenizer is None:
            raise ScoreError(f"{field}: this model has no tokenizer; give token ids")
        return tokenizer.encode(text_or_ids, add_special_tokens=special)

    return ScoreInput(
        tuple(ids(prefix, "prefix", special=True)),
        tuple(tuple(ids(it, f"items[{i}]")) for i, it in enumerate(items)),
        tuple(int(t) for t in label_token_ids),
    )


def validate(inp: ScoreInput, vocab_size: int, max_model_len: int) -> None:
    """Raise ScoreError naming the first bad field."""
    if not inp.prefix_ids:
        raise ScoreError("prefix must not be empty")
    if not inp.items_ids:
        raise ScoreError("items must not be empty")
    if not inp.label_token_ids:
        raise ScoreError("label_token_ids must not be empty")
    for name, ids in (("prefix", inp.prefix_ids), ("label_token_ids", inp.label_token_ids)):
        if any(t < 0 or t >= vocab_size for t in ids):
            raise ScoreError(f"{name} token ids must lie in [0, {vocab_size})")
    for i, item in enumerate(inp.items_ids):
        if not item:
            raise ScoreError(f"items[{i}] must not be empty")
        if any(t < 0 or t >= vocab_size for t in item):
            raise ScoreError(f"items[{i}] token ids must lie in [0, {vocab_size})")
        if len(inp.prefix_ids) + len(item) > max_model_len:
            raise ScoreError(f"prefix + items[{i}] exceeds the model's context ({max_model_len})")


def score(
    runner: ModelRunner, pool: BlockPool, block_size: int, inp: ScoreInput
) -> list[list[float]]:
    """Log-probs of each label token after `prefix + item`, per item, in one pass.

    Takes blocks from `pool` for the pass and gives them all back; raises ScoreError when the
    pool is too small ever to hold the pass, NoFreeBlocksError when too few of its blocks are
    free now. Must not run during an engine step (it uses the same KV caches).
    """
    p = len(inp.prefix_ids)
    items = inp.items_ids
    shared = p // block_size  # full prefix blocks the items' tables point at
    leader_len = p + len(items[0])
    own = [-(-(p + len(it)) // block_size) - shared for it in items[1:]]
    need = -(-leader_len // block_size) + sum(own)
    if need > pool.num_blocks:
        raise ScoreError(
            f"items: prefix + items need {need} KV blocks, the pool has {pool.num_blocks}; "
            "send fewer or shorter items"
        )
    if need > pool.num_free:
        raise NoFreeBlocksError(
            f"scoring needs {need} KV blocks, {pool.num_free} are free now; retry later"
        )
    leader = pool.allocate(-(-leader_len // block_size))
    tables: list[list[BlockId]] = [leader]
    try:
        for n in own:
            tables.append(leader[:shared] + pool.allocate(n))
        return _run(runner, inp, tables, block_size)
    finally:
        pool.free([b for t in tables for b in reversed(t[shared:] if t is not leader else t)])


def _run(
    runner: ModelRunner, inp: ScoreInput, tables: list[list[BlockId]], block_size: int
) -> list[list[float]]:
    p = len(inp.prefix_ids)
    items = inp.items_ids
    qo_lens = [p + len(items[0])] + [len(it) for it in items[1:]]
    kv_lens = [p + len(it) for it in items]
    layout = build_scheme_layout(
        "multi_item",
        qo_lens,
        kv_lens,
        tables,
        block_size,
        groups=[list(range(len(items)))],
        prefix_lens=[p],
        device=str(runner.device),
    )
    tokens = list(inp.prefix_ids) + [t for it in items for t in it]
    positions = list(range(p + len(items[0])))
    for it in items[1:]:
        positions.extend(range(p, p + len(it)))
    ends = torch.tensor(qo_lens).cumsum(0) - 1
    logits = runner.forward_layout(tokens, positions, layout, ends.tolist())
    logprobs = torch.log_softmax(logits.float(), dim=-1)[:, list(inp.label_token_ids)]
    return [[float(x) for x in row] for row in logprobs.tolist()]
