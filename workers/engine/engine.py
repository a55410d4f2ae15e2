"""The step loop: schedule, run, sample, check stops, report."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from cachesvc.block_pool import BlockPool
from cachesvc.config import EngineConfig
from cachesvc.types import RequestId
from workers.attention.base import get_backend
from workers.engine.kv_manager import KVCacheManager
from workers.engine.outputs import RequestOutput
from workers.engine.request import FinishReason, Request
from workers.engine.runner import ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.stop import check_stop
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.loader import LoadedModel, load_model
from workers.model.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _load_tokenizer(path: Path) -> Tokenizer | None:
    """The model's tokenizer; None for a folder that ships none (the engine then takes ids)."""
    if path.is_dir() and not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_path(path)


class PromptError(ValueError):
    """A prompt the engine cannot serve (empty, too long, bad token ids)."""


@dataclass
class _Tracked:
    """Per-request text state that the engine (not the scheduler) owns."""

    request: Request
    detok: IncrementalDetokenizer | None
    text: str = ""
    stopped_text: str | None = None
    num_computed: int = field(default=0)


class Engine:
    """One model over one paged KV pool; usable step by step or through `generate`."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.loaded = loaded or load_model(
            config.model, dtype=_DTYPES[config.dtype], device=config.device
        )
        self.tokenizer = tokenizer or _load_tokenizer(self.loaded.path)
        model_cfg = self.loaded.config
        self.max_model_len = min(
            config.max_model_len or model_cfg.max_position_embeddings,
            model_cfg.max_position_embeddings,
        )
        num_blocks = config.num_blocks or self._blocks_for_budget(config)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCacheManager(
            self.pool,
            config.block_size,
            model_fingerprint=self.loaded.fingerprint,
            enable_prefix_caching=config.enable_prefix_caching,
            in_batch=config.in_batch_mode,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_batched_tokens, config.max_num_seqs, config.enable_chunked_prefill
            ),
            self.kv,
        )
        kv_caches = self.loaded.model.allocate_kv_cache(
            num_blocks, config.block_size, dtype=_DTYPES[config.dtype], device=config.device
        )
        self.runner = ModelRunner(
            self.loaded.model,
            get_backend(config.attention_backend),
            kv_caches,
            config.block_size,
            config.device,
        )
        self._tracked: dict[RequestId, _Tracked] = {}
        self._ids = itertools.count()

    def _blocks_for_budget(self, config: EngineConfig) -> int:
        c = self.loaded.config
        bytes_per_block = (
            c.num_layers
            * 2
            * config.block_size
            * c.num_kv_heads
            * c.head_dim
            * _DTYPES[config.dtype].itemsize
        )
        return max(1, config.kv_cache_mb * 2**20 // bytes_per_block)

    # ---- requests ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or ids; raises PromptError when unusable."""
        if isinstance(prompt, str):
            if not prompt:
                raise PromptError("prompt is empty")
            if self.tokenizer is None:
                raise PromptError("this model has no tokenizer: give token ids, not text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("prompt has no tokens")
        vocab = self.loaded.config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise PromptError(f"prompt token ids must lie in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"prompt has {len(ids)} tokens; the model's context is "
                f"{self.max_model_len} (room for at least one output token needed)"
            )
        if self.kv.num_blocks_for(len(ids) + 1) > self.pool.num_blocks:
            raise PromptError(
                f"prompt of {len(ids)} tokens does not fit the KV pool of "
                f"{self.pool.num_blocks} blocks"
            )
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestId]:
        """Queue a prompt; returns one request id per sample (`params.n` of them)."""
        ids = self.encode_prompt(prompt)
        base = request_id or f"req-{next(self._ids)}"
        out: list[RequestId] = []
        for i in range(params.n):
            rid = RequestId(base if params.n == 1 else f"{base}-{i}")
            if rid in self._tracked:
                raise PromptError(f"request id {rid!r} is already in use")
            sample_params = (
                params
                if params.n == 1
                else replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            )
            request = Request(
                rid,
                list(ids),
                sample_params,
                eos_token_ids=self._eos_ids(),
                cache_salt=cache_salt,
            )
            detok = None if self.tokenizer is None else IncrementalDetokenizer(self.tokenizer)
            self._tracked[rid] = _Tracked(request, detok)
            self.scheduler.add(request)
            out.append(rid)
        return out

    def abort(self, request_id: RequestId) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self.scheduler.finish(tracked.request)
            tracked.request.finish(FinishReason.ABORT, time.perf_counter())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.loaded.config.eos_token_ids)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns a snapshot of every request that advanced."""
        output = self.scheduler.schedule()
        if output.is_empty:
            return []
        requests = {rid: t.request for rid, t in self._tracked.items()}
        sampled = self.runner.execute(output, requests)
        self.scheduler.update(output)
        now = time.perf_counter()
        results: list[RequestOutput] = []
        for chunk in output.chunks:
            tracked = self._tracked[chunk.request_id]
            # Usage counts prompt tokens only: cached + computed == prompt length (without
            # preemption; recomputation after one counts again).
            prompt_end = tracked.request.num_prompt_tokens
            tracked.num_computed += max(
                0, min(prompt_end, chunk.start_pos + len(chunk.token_ids)) - chunk.start_pos
            )
            if chunk.request_id in sampled:
                results.append(self._on_token(tracked, sampled[chunk.request_id], now))
        return results

    def _on_token(self, tracked: _Tracked, token_id: int, now: float) -> RequestOutput:
        request = tracked.request
        request.append_token(token_id, now)
        before = len(tracked.text)
        delta = "" if tracked.detok is None else tracked.detok.add(token_id)
        tracked.text += delta
        decision = check_stop(request, tracked.text, before, self.max_model_len)
        if decision is not None:
            if decision.truncate_text_at is None and tracked.detok is not None:
                # Release text held back for an incomplete character at the very end.
                tracked.text += tracked.detok.finish()
            if decision.truncate_text_at is not None:
                tracked.text = tracked.text[: decision.truncate_text_at]
            delta = tracked.text[before:]
            self.scheduler.finish(request)
            request.finish(decision.reason, now, decision.stop_reason)
            del self._tracked[request.request_id]
        return self._snapshot(tracked, delta)

    def _snapshot(self, tracked: _Tracked, delta: str) -> RequestOutput:
        r = tracked.request
        ttft = None if r.first_token_time is None else (r.first_token_time - r.arrival_time) * 1e3
        tps = None
        if (
            r.finish_time is not None
            and r.first_token_time is not None
            and len(r.output_token_ids) > 1
            and r.finish_time > r.first_token_time
        ):
            tps = (len(r.output_token_ids) - 1) / (r.finish_time - r.first_token_time)
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=tuple(r.prompt_token_ids),
            token_ids=tuple(r.output_token_ids),
            text=tracked.text,
            delta_text=delta,
            finished=r.is_finished,
            finish_reason=None if r.finish_reason is None else r.finish_reason.value,
            ttft_ms=ttft,
            decode_tokens_per_s=tps,
            num_cached_tokens=r.num_cached_tokens,
            num_computed_tokens=tracked.num_computed,
            num_preemptions=r.num_preemptions,
        )

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; the final output of each, in order (n samples in a row)."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.encode_prompt(p) for p in prompts]  # validate all before queueing any
        order: list[RequestId] = []
        for prompt_ids, p in zip(ids, per_prompt, strict=True):
            order.extend(self.add_request(prompt_ids, p, cache_salt=cache_salt))
        final: dict[RequestId, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in order]
