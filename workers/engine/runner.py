"""The only place that builds tensors: scheduler output in, sampled token ids out."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from cachesvc.types import RequestId
from workers.attention.base import AttentionBackend
from workers.attention.layout import build_layout
from workers.engine.request import Request
from workers.engine.sampler import sample
from workers.engine.scheduler import SchedulerOutput
from workers.model.llama import LlamaModel


class ModelRunner:
    """Runs the model over a flat ragged batch and samples the requests that reached their end."""

    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(
        self, output: SchedulerOutput, requests: Mapping[RequestId, Request]
    ) -> dict[RequestId, int]:
        """Compute every scheduled chunk; returns the sampled token of each finished chunk."""
        chunks = output.chunks
        token_ids: list[int] = []
        positions: list[int] = []
        logits_rows: list[int] = []
        for chunk in chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)))
            if chunk.sample:
                logits_rows.append(len(token_ids) - 1)
        layout = build_layout(
            qo_lens=[len(c.token_ids) for c in chunks],
            kv_lens=[c.start_pos + len(c.token_ids) for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            page_size=self.block_size,
            device=self.device,
        )
        self.backend.plan(layout)
        logits = self.model(
            torch.tensor(token_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            layout,
            self.backend,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        sampled = [requests[c.request_id] for c in chunks if c.sample]
        token_out = sample(
            logits.float().cpu(),
            [r.params for r in sampled],
            [r.generator for r in sampled],
        )
        return {r.request_id: t for r, t in zip(sampled, token_out, strict=True)}
