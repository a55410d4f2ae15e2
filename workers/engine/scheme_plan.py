"""Per-step choice of the shared-prefix attention scheme, and the layout that runs it.

The scheduler decides which tokens each request computes; this module only looks at the batch
it produced. Requests whose block tables start with the same block share a prefix: they are
ordered next to each other (leader first, the one computing the prefix), measured as a
`BatchShape` (P, S, M), and the scheme is either the configured one or `choose_scheme`'s pick,
from the costs `startup_costs` measured for this machine, backend and model when the engine
started.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.attention.cascade import find_prefix_groups
from workers.attention.scheme_calibration import CalibrationTarget, scheme_costs
from workers.attention.schemes import (
    BatchShape,
    SchemeCosts,
    SchemeLayout,
    build_scheme_layout,
    choose_scheme,
)
from workers.config import EngineConfig
from workers.engine.scheduler import ScheduledChunk
from workers.model.config import ModelConfig

PLAIN = ("naive", "split", "ragged")


@dataclass(frozen=True)
class StepPlan:
    """The chunks in execution order and the layout of the chosen scheme."""

    chunks: tuple[ScheduledChunk, ...]
    layout: SchemeLayout
    shape: BatchShape | None  # of the largest sharing group; None when nothing is shared


def order_for_sharing(chunks: Sequence[ScheduledChunk]) -> tuple[ScheduledChunk, ...]:
    """Sharers of a first block next to each other, the one that starts earliest first."""
    indexed = list(enumerate(chunks))
    indexed.sort(
        key=lambda ic: (ic[1].block_ids[0] if ic[1].block_ids else -1, ic[1].start_pos, ic[0])
    )
    return tuple(c for _, c in indexed)


def item_groups(
    chunks: Sequence[ScheduledChunk], block_size: int
) -> tuple[list[list[int]], list[int]]:
    """Leader + items groups for multi-item attention (one logical request per group).

    A member joins its leader when it computes exactly the tokens after a block-aligned prefix
    it shares with the leader, and the leader computes its own tokens from that prefix on.
    Everything else is a group of one whose prefix is its whole sequence (plain causal).
    """
    groups: list[list[int]] = []
    prefix_lens: list[int] = []
    for b, chunk in enumerate(chunks):
        if groups and _joins(
            chunks[groups[-1][0]], chunk, prefix_lens[-1], block_size, len(groups[-1]) == 1
        ):
            if len(groups[-1]) == 1:
                prefix_lens[-1] = chunk.start_pos
            groups[-1].append(b)
            continue
        groups.append([b])
        prefix_lens.append(chunk.start_pos + len(chunk.token_ids))
    return groups, prefix_lens


def _joins(
    leader: ScheduledChunk, chunk: ScheduledChunk, prefix_len: int, block_size: int, first: bool
) -> bool:
    p = chunk.start_pos
    if p == 0 or p % block_size or (not first and p != prefix_len):
        return False
    shared = p // block_size
    leader_end = leader.start_pos + len(leader.token_ids)
    return leader.start_pos <= p <= leader_end and tuple(chunk.block_ids[:shared]) == tuple(
        leader.block_ids[:shared]
    )


def batch_shape(
    chunks: Sequence[ScheduledChunk], block_size: int, backend: str
) -> BatchShape | None:
    """P, S, M of the largest group of requests sharing leading blocks."""
    tables = [c.block_ids for c in chunks]
    qo = [len(c.token_ids) for c in chunks]
    kv = [c.start_pos + len(c.token_ids) for c in chunks]
    decode = all(n == 1 for n in qo)
    if decode:  # decodes share cached pages only (item groups need a prefill)
        groups, pages = find_prefix_groups(qo, kv, tables, block_size)
        prefix_lens = [n * block_size for n in pages]
    else:
        groups, prefix_lens = item_groups(chunks, block_size)
    best = max(range(len(groups)), key=lambda g: len(groups[g]))
    members = groups[best]
    if len(members) < 2:
        return None
    suffix = sum(kv[b] - prefix_lens[best] for b in members) // len(members)
    return BatchShape(prefix_lens[best], max(suffix, 1), len(members), backend, decode)


def plan_step(
    chunks: Sequence[ScheduledChunk],
    block_size: int,
    scheme: str,
    backend: str,
    costs: SchemeCosts | None = None,
    device: str = "cpu",
) -> StepPlan:
    """Order the chunks, pick the scheme (configured, or chosen from the batch's shape) and
    build its layout."""
    ordered = order_for_sharing(chunks)
    shape = batch_shape(ordered, block_size, backend)
    if scheme == "auto":
        scheme = "ragged" if shape is None else choose_scheme(shape, costs)
    args = (
        [len(c.token_ids) for c in ordered],
        [c.start_pos + len(c.token_ids) for c in ordered],
        [c.block_ids for c in ordered],
        block_size,
    )
    if scheme in ("multi_item", "custom_mask"):
        groups, prefix_lens = item_groups(ordered, block_size)
        layout = build_scheme_layout(
            scheme, *args, groups=groups, prefix_lens=prefix_lens, device=device
        )
    elif scheme == "cascade":
        layout = build_scheme_layout("cascade", *args, device=device)
    else:
        layout = build_scheme_layout("ragged" if scheme in PLAIN else scheme, *args, device=device)
    return StepPlan(ordered, layout, shape)


def startup_costs(
    config: EngineConfig, model: ModelConfig, cache_dir: Path | None = None
) -> SchemeCosts | None:
    """The prefill schemes' costs for this engine's backend, device, dtype, heads and block
    size, measured now (seconds) or read from this machine's cache; None (the built-in rule)
    when the scheme is fixed, calibration is off, or it failed. Run it after the thread count
    is set: the costs depend on it."""
    if config.prefill_scheme != "auto":
        return None
    target = CalibrationTarget(
        backend=config.attention_backend,
        device=str(config.device),
        dtype=getattr(torch, config.dtype),
        num_qo_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        page_size=config.block_size,
    )
    return scheme_costs(target, config.scheme_calibration, cache_dir)
