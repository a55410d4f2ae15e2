"""The model's per-token inputs of one step (token ids, positions, the rows to sample), built
for the whole batch at once into buffers that persist from step to step.

Why persistent: a CUDA graph replays reads of the addresses it was captured with. The buffers
are allocated once (grown, rarely, when a step needs more rows) and a step's inputs are views of
their first rows, so a decode step of a fixed batch size always reads the same memory. The plan
for graphs on a GPU, which this layout is shaped for: capture the decode step once per batch
size B in a ladder (1, 2, 4, 8, 16, 24, 32, ... up to `max_num_seqs`); a step of n <= B decodes
fills rows `:n`, pads rows `n:B` (token 0, position 0, a write slot in a scratch page that no
request owns, a KV length of 1) and replays the graph of B. The attention layout's index tensors
get the same treatment (FlashInfer's CUDA-graph decode wrapper takes persistent `kv_indptr`,
`kv_indices` and `kv_last_page_len` buffers, and its `plan()` copies each step's into them).
On CPU nothing is captured: rows past n are never read, so they are not padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain

import torch

from workers.engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class StepInputs:
    """Views of the persistent buffers, valid until the next `build`."""

    token_ids: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    logits_rows: torch.Tensor  # int64 [num_sampled]: the query row of each sampling chunk
    # int64 [num_sampled]: for the model to write each logits row's argmax into (greedy's token)
    argmax: torch.Tensor


class InputBuffers:
    """Four int64 rows of `capacity` entries on `device` (token ids, positions, logits rows, and
    the logits rows' argmax, which the model writes)."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._rows = torch.zeros(4, max(capacity, 1), dtype=torch.int64, device=self.device)

    @property
    def capacity(self) -> int:
        return self._rows.shape[1]

    def build(self, chunks: Sequence[ScheduledChunk]) -> StepInputs:
        """The inputs of `chunks` in order; overwrites the previous step's (whose views then
        read the new values). Grows the buffers when the step has more tokens than they hold."""
        token_ids = list(chain.from_iterable(c.token_ids for c in chunks))
        num_tokens = len(token_ids)
        if all(len(c.token_ids) == 1 for c in chunks):  # decodes: one position each
            positions = [c.start_pos for c in chunks]
        else:
            positions = list(
                chain.from_iterable(
                    range(c.start_pos, c.start_pos + len(c.token_ids)) for c in chunks
                )
            )
        ends = accumulate(len(c.token_ids) for c in chunks)
        logits_rows = [end - 1 for end, c in zip(ends, chunks, strict=True) if c.sample]
        if num_tokens > self.capacity:
            self._rows = torch.zeros(
                4, max(num_tokens, 2 * self.capacity), dtype=torch.int64, device=self.device
            )
        host = torch.tensor([token_ids, positions], dtype=torch.int64)
        self._rows[:2, :num_tokens].copy_(host, non_blocking=True)
        num_rows = len(logits_rows)
        self._rows[2, :num_rows].copy_(
            torch.tensor(logits_rows, dtype=torch.int64), non_blocking=True
        )
        return StepInputs(
            self._rows[0, :num_tokens],
            self._rows[1, :num_tokens],
            self._rows[2, :num_rows],
            self._rows[3, :num_rows],
        )
