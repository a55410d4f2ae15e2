"""The only place that builds tensors: scheduler output in, sampled token ids out."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cachesvc.kv.types import RequestId
from workers.attention.base import AttentionBackend
from workers.attention.schemes import SchemeCosts
from workers.engine.kv_copy import copy_blocks
from workers.engine.request import Request
from workers.engine.sampler import sample_each
from workers.engine.scheduler import SchedulerOutput
from workers.engine.scheme_plan import plan_step
from workers.engine.step_inputs import InputBuffers
from workers.model.llama import LlamaModel


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens, the raw logits rows that the engine asked to keep, and the requests whose
    sampling raised (each its own error: the others of the batch sampled as usual)."""

    sampled: dict[RequestId, int]
    logits: dict[RequestId, torch.Tensor] = field(default_factory=dict)  # float32 [vocab]
    failed: dict[RequestId, Exception] = field(default_factory=dict)


class ModelRunner:
    """Runs the model over a flat ragged batch and samples the requests that reached their end."""

    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device | str = "cpu",
        scheme: str = "auto",
        costs: SchemeCosts | None = None,
        max_num_tokens: int = 2048,
    ) -> None:
        self.model = model
        self.backend = backend  # a SchemeBackend: it runs whichever scheme the layout names
        self.scheme = scheme
        self.costs = costs
        self.last_scheme = ""  # what the latest step ran, for stats and tests
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        # The step's token ids, positions and sampled rows, in buffers kept across steps.
        self.inputs = InputBuffers(max_num_tokens, self.device)

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        requests: Mapping[RequestId, Request],
        keep_logits: Collection[RequestId] = (),
    ) -> StepResult:
        """Compute every scheduled chunk; sample the next token of each chunk that reaches the
        end of its request, and keep the logits of the requests in `keep_logits`.

        Raises when the model run does (the whole batch is lost); a request whose own sampling
        raises is reported in `StepResult.failed` instead."""
        plan = plan_step(
            output.chunks,
            self.block_size,
            self.scheme,
            getattr(getattr(self.backend, "inner", None), "name", "torch"),
            self.costs,
            str(self.device),
        )
        chunks = plan.chunks
        self.last_scheme = plan.layout.scheme
        inputs = self.inputs.build(chunks)
        layout = plan.layout
        self.backend.plan(layout)  # type: ignore[arg-type]
        logits = self.model(
            inputs.token_ids,
            inputs.positions,
            self.kv_caches,
            layout,  # type: ignore[arg-type]  # the scheme backend reads its scheme layout
            self.backend,
            inputs.logits_rows,
            inputs.argmax,  # greedy rows' tokens, found as the LM head computes the logits
        )
        logits = logits.float().cpu()
        sampled = [requests[c.request_id] for c in chunks if c.sample]
        kept = {
            r.request_id: logits[i] for i, r in enumerate(sampled) if r.request_id in keep_logits
        }
        tokens, failed = _sample_each(logits, sampled, inputs.argmax.tolist())
        return StepResult(tokens, kept, failed)

    @torch.inference_mode()
    def forward_layout(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        layout: object,
        logits_rows: Sequence[int],
    ) -> torch.Tensor:
        """One model pass over a prepared (scheme) layout; float32 logits of `logits_rows`."""
        self.backend.plan(layout)  # type: ignore[arg-type]
        logits = self.model(
            torch.tensor(list(token_ids), dtype=torch.long, device=self.device),
            torch.tensor(list(positions), dtype=torch.long, device=self.device),
            self.kv_caches,
            layout,  # type: ignore[arg-type]
            self.backend,
            torch.tensor(list(logits_rows), dtype=torch.long, device=self.device),
        )
        return logits.float().cpu()

    @torch.inference_mode()
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the KV of block `src` into block `dst` in every layer (copy-on-write)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=self.device)
        copy_blocks(self.kv_caches, src, dst)


def _sample_each(
    logits: torch.Tensor, requests: Sequence[Request], argmax: Sequence[int]
) -> tuple[dict[RequestId, int], dict[RequestId, Exception]]:
    """Row i of `logits` sampled for `requests[i]` (the whole batch at once, `sample_each`;
    `argmax` is each row's, the greedy rows' tokens): the tokens, and the errors of the rows
    that raised, each kept to its own request."""
    # A greedy row takes no generator: re-seeding one per row is a cost of the seeded only.
    generators = [None if r.params.greedy else r.next_generator() for r in requests]
    results = sample_each(logits, [r.params for r in requests], generators, argmax)
    sampled: dict[RequestId, int] = {}
    failed: dict[RequestId, Exception] = {}
    for request, token in zip(requests, results, strict=True):
        if isinstance(token, Exception):
            failed[request.request_id] = token
        else:
            sampled[request.request_id] = token
    return sampled, failed
