"""The engine (`Engine`): one model over one paged KV pool, and its step loop: schedule, run,
sample, check stops, fork samples and beams, report.

Requests come in through `add_request` (or `generate`, `score`). The cache operations run
between steps (`flush`, `purge`, `close`, `attach_peers`), the pool's sizing and the tiers'
start-up live in `cache_admin`; the engine's methods delegate to it.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.types import RequestId
from workers.attention.schemes import make_scheme_backend
from workers.config import EngineConfig
from workers.engine.beam_search import BeamSearch
from workers.engine.cache_admin import blocks_for_budget, start_cache
from workers.engine.forking import Forker
from workers.engine.kv_manager import KVCacheManager
from workers.engine.outputs import RequestFailed, RequestOutput
from workers.engine.prompt import PromptError, encode_prompt
from workers.engine.request import FinishReason, PeerSource, Request
from workers.engine.runner import ModelRunner, StepResult
from workers.engine.sampler import sample
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.engine.scheme_plan import startup_costs
from workers.engine.scoring import encode_input, validate
from workers.engine.scoring import score as run_score
from workers.engine.suspects import Verdict
from workers.engine.tracking import Tracked, beam_snapshot, snapshot
from workers.kernels.heap import retain_freed_heap
from workers.model.loader import LoadedModel, load_model
from workers.protocol import CacheHints
from workers.sampling_params import SamplingParams
from workers.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from workers.engine.tiering.peer import PeerLink

_log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_LOAD_WAIT_S = 0.01  # a step with only pulls in flight waits this long for one to land


def _load_tokenizer(path: Path) -> Tokenizer | None:
    """The model's tokenizer; None for a folder that ships none (the engine then takes ids)."""
    if path.is_dir() and not (path / "tokenizer.json").exists():
        return None
    return Tokenizer.from_path(path)


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
        if config.retain_freed_heap and torch.device(config.device).type == "cpu":
            retain_freed_heap()
        self.config = config
        self.loaded = loaded or load_model(
            config.model, dtype=_DTYPES[config.dtype], device=config.device
        )
        self.tokenizer = tokenizer or _load_tokenizer(self.loaded.path)
        context_len = self.loaded.config.max_context_len  # a sliding window caps it
        self.max_model_len = min(config.max_model_len or context_len, context_len)
        num_blocks = config.num_blocks or blocks_for_budget(
            config, self.loaded.config, _DTYPES[config.dtype].itemsize
        )
        self.pool = BlockPool(num_blocks, policy=config.eviction_policy)
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
            make_scheme_backend(config.attention_backend),
            kv_caches,
            config.block_size,
            config.device,
            scheme=config.prefill_scheme,
            max_num_tokens=config.max_num_batched_tokens,
            costs=startup_costs(config, self.loaded.config),
        )
        self._tracked: dict[RequestId, Tracked] = {}  # requests whose output a caller sees
        self._requests: dict[RequestId, Request] = {}  # every live request, beams included
        self._fork_plans: dict[RequestId, list[tuple[RequestId, SamplingParams]]] = {}
        self._ids = itertools.count()
        self.cache_admin = start_cache(
            config, self.pool, self.kv, self.runner, kv_caches, self.loaded.fingerprint
        )
        self.tiering = self.cache_admin.tiering
        self.forker = Forker(self.scheduler, self.kv, self.runner)
        self.beams = BeamSearch(self.forker, self._requests, self._drop, self.max_model_len)

    def attach_peers(self, link: PeerLink) -> None:
        """Pull blocks from the peers requests name through `link` (with `peer_pull` on)."""
        self.cache_admin.attach_peers(link)

    def close(self) -> None:
        """Flush the tiers' background writes and close them (an NVMe folder is then complete).

        With an NVMe tier, the device pool's cached blocks (those no request holds) are demoted
        first, and whatever DRAM holds moves on to NVMe, so that a restart finds them there.
        """
        self.cache_admin.close()

    def flush(self) -> int:
        """Drop every cached device block that no request holds, without demoting it to the
        tiers (BlockRemoved events); returns how many were dropped. Tier blocks whose prefix was
        only on the device go too (nothing could reach them). Run it between steps."""
        return self.cache_admin.flush()

    def purge(self) -> dict[str, int]:
        """Drop everything this worker holds, in every tier: the device pool's cached blocks
        that no request holds (not demoted), DRAM, NVMe, and this model's blocks in the shared
        Redis tier (every worker's: it is one store). Returns how many blocks each tier dropped,
        by tier name ("hbm" for the device); emits BlockRemoved / Cleared. Run it between steps.
        """
        return self.cache_admin.purge()

    # ---- requests ---------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text or ids; raises PromptError when unusable."""
        return encode_prompt(
            prompt,
            self.tokenizer,
            self.loaded.config.vocab_size,
            self.max_model_len,
            self.pool.num_blocks,
            self.kv.num_blocks_for,
        )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        peer: PeerSource | None = None,
        cache: CacheHints | None = None,
    ) -> list[RequestId]:
        """Queue a prompt; returns one request id per output (`params.n` of them). `peer`: a
        worker holding more of the prompt, that the load planner may pull it from.

        With `n > 1` the prompt is computed once: the other samples fork from the first when it
        samples its first token. With `beam_width > 1` one id is returned, for the best beam.
        """
        ids = self.encode_prompt(prompt)
        base = request_id or f"req-{next(self._ids)}"
        out = [RequestId(base if params.n == 1 else f"{base}-{i}") for i in range(params.n)]
        if any(rid in self._tracked or rid in self._requests for rid in out):
            raise PromptError(f"request id {base!r} is already in use")
        first = Request(
            out[0],
            list(ids),
            params if params.n == 1 else params.for_sample(0),
            eos_token_ids=self._eos_ids(),
            cache_salt=cache_salt,
            peer=peer,
            cache=cache or CacheHints(),
        )
        self._requests[first.request_id] = first
        if params.beam_width > 1:
            self.beams.start(first)
        else:
            self._tracked[first.request_id] = Tracked.start(first, self.tokenizer)
        if params.n > 1:
            self._fork_plans[first.request_id] = [
                (rid, params.for_sample(i)) for i, rid in enumerate(out) if i > 0
            ]
        self.scheduler.add(first)
        return out

    def abort(self, request_id: RequestId) -> None:
        """Stop a request now and free its blocks; unknown ids are ignored."""
        self.beams.abort(request_id)
        for parent, plan in self._fork_plans.items():
            self._fork_plans[parent] = [(rid, p) for rid, p in plan if rid != request_id]
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._drop(tracked.request)
            tracked.request.finish(FinishReason.ABORT, time.perf_counter())
            self._fork_plans.pop(request_id, None)

    def _drop(self, request: Request) -> None:
        """Forget a live request and free its blocks."""
        self.scheduler.finish(request)
        self._requests.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None:
            return tuple(self.tokenizer.eos_token_ids)
        return tuple(self.loaded.config.eos_token_ids)

    # ---- the loop ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns a snapshot of every request that advanced.

        An exception while handling one request (sampling its row, its stop check, detokenizing,
        forking its samples, advancing its beams) fails that request alone (`_fail`); the
        batch's other requests go on as if it had not been there. A model run that raises
        (nothing says which request caused it) undoes the step: the blocks it registered are
        forgotten (their KV was never written), its requests requeued as if preempted; then it
        fails whom `workers.engine.suspects` says (`_on_failed_run`).
        """
        output = self.scheduler.schedule()
        self.cache_admin.after_evictions()
        if output.is_empty:
            if self.tiering is not None:
                self.tiering.wait_for_loads(_LOAD_WAIT_S)  # nothing to do until a pull lands
            return []
        keep = set(self._fork_plans) | set(self.beams.group_of)
        start = time.perf_counter()
        try:
            result = self.runner.execute(output, self._requests, keep)
        except BaseException as exc:
            self.kv.abort_step()
            self.scheduler.requeue(output)
            if not isinstance(exc, Exception):
                raise
            return self._on_failed_run(output, exc)
        compute_s = time.perf_counter() - start
        self.scheduler.update(output)  # may land a fetch that ran during the compute (Cake)
        if self.tiering is not None:
            self.tiering.after_step(output, compute_s)
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        for chunk in output.chunks:
            rid = chunk.request_id
            tracked = self._tracked.get(rid)
            if tracked is not None:
                tracked.count_computed(chunk.start_pos, len(chunk.token_ids))
            known = self._requests.get(rid)
            if known is None:
                continue  # a beam whose group failed earlier in this loop
            error = result.failed.get(rid)
            if error is None and rid in result.sampled:
                try:
                    outputs.extend(self._on_sampled(rid, result, now))
                except Exception as exc:  # this request's own failure, see the docstring
                    error = exc
            if error is not None:
                outputs.append(self._fail(rid, error, now, known))
        for group in self.beams.ready_groups():
            finished = None
            try:
                finished = self.beams.advance(group, now)
                if finished is not None:
                    lossy = self._lossy_kv(finished.request_id)
                    outputs.append(beam_snapshot(finished, self.tokenizer, lossy))
            except Exception as exc:
                outputs.append(self._fail(group.public_id, exc, now, finished))
        return outputs

    def _on_failed_run(self, output: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The model run of `output` raised and the step was undone. It fails no one yet (the
        requests run again, a failed batch's alone), the request that failed alone twice (its
        output says so), or all of them: `exc` propagates, as from a faulty worker."""
        verdict = self.scheduler.suspects.on_failed_run(output.chunks)
        if verdict is Verdict.WORKER_FAULT:
            raise exc
        if verdict is Verdict.REQUEUED:
            _log.warning("a model run of %d request(s) failed", len(output.chunks), exc_info=exc)
            return []
        return [self._fail(output.chunks[0].request_id, exc, time.perf_counter())]

    def _on_sampled(self, rid: RequestId, result: StepResult, now: float) -> list[RequestOutput]:
        """What a request that sampled this step reports (nothing yet for a beam)."""
        if self.beams.is_beam(rid):
            self.beams.on_logits(rid, result.logits[rid], now)
            return []
        outputs = []
        if rid in self._fork_plans:
            outputs = self._fork_samples(rid, result.logits[rid], now)
        outputs.append(self._on_token(self._tracked[rid], result.sampled[rid], now))
        return outputs

    def _fork_samples(
        self, parent_id: RequestId, logits: torch.Tensor, now: float
    ) -> list[RequestOutput]:
        """Samples 1..n-1 of a prompt start from the first's KV and logits."""
        parent = self._requests[parent_id]
        outputs = []
        for rid, params in self._fork_plans.pop(parent_id):
            child = self.forker.fork(parent, rid, params)
            self._requests[rid] = child
            tracked = self._tracked[rid] = Tracked.start(child, self.tokenizer)
            [token] = sample(logits[None], [params], [child.next_generator()])
            outputs.append(self._on_token(tracked, token, now))
        return outputs

    def _fail(
        self, rid: RequestId, exc: Exception, now: float, known: Request | None = None
    ) -> RequestOutput:
        """Drop request `rid` after `exc` while serving it, with its whole beam group and the
        samples it was yet to fork (the stream of its samples ends with it); its final output,
        finish reason "error". `known`: the request as the step found it (it may be gone from
        the engine's books already, e.g. a stop check that raised after it finished)."""
        _log.error("request %s failed in an engine step", rid, exc_info=exc)
        origin = self.beams.abort(rid)  # a beam's output goes by its group's public id
        request = origin or self._requests.get(rid) or known
        assert request is not None, f"request {rid} failed unknown"
        self._fork_plans.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None) or Tracked(request, None)
        self._drop(request)
        request.finish(FinishReason.ERROR, now)
        # Whatever a failure cut off half-made (a fork not yet on the books) holds no block.
        for orphan in [*self.scheduler.running, *self.scheduler.waiting]:
            if orphan.request_id not in self._requests:
                self.scheduler.finish(orphan)
        return dataclasses.replace(snapshot(tracked, ""), error=f"{type(exc).__name__}: {exc}")

    def _tier_usage(self, request_id: RequestId) -> dict[str, int] | None:
        return None if self.tiering is None else self.tiering.usage(request_id)

    def _lossy_kv(self, request_id: RequestId) -> bool:
        return self.tiering is not None and self.tiering.lossy_kv(request_id)

    def _on_token(self, tracked: Tracked, token_id: int, now: float) -> RequestOutput:
        request = tracked.request
        delta, decision = tracked.add_token(token_id, now, self.max_model_len)
        if decision is not None:
            self._drop(request)
            request.finish(decision.reason, now, decision.stop_reason)
            del self._tracked[request.request_id]
        rid = request.request_id
        return snapshot(tracked, delta, self._tier_usage(rid), self._lossy_kv(rid))

    def score(
        self,
        prefix: str | Sequence[int],
        items: Sequence[str | Sequence[int]],
        label_token_ids: Sequence[int],
    ) -> list[list[float]]:
        """For each item, the log-probs of `label_token_ids` right after `prefix + item`.

        One forward pass with the multi-item mask; equal to scoring each `prefix + item` alone.
        Raises ScoreError (a ValueError) naming the bad field, including a pass that could never
        fit the pool, and NoFreeBlocksError when too few blocks are free right now (requests hold
        them: retry later). Run it between steps.
        """
        inp = encode_input(self.tokenizer, prefix, items, label_token_ids)
        validate(inp, self.loaded.config.vocab_size, self.max_model_len)
        try:
            return run_score(self.runner, self.pool, self.config.block_size, inp)
        finally:
            self.cache_admin.after_evictions()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        cache_salt: str | None = None,
        cache: CacheHints | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; the final output of each, in order (n samples in a row).
        `cache`: every prompt's explicit cache controls. Raises RequestFailed, once every
        prompt has finished, when the engine failed one."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [self.encode_prompt(p) for p in prompts]  # validate all before queueing any
        order: list[RequestId] = []
        for prompt_ids, p in zip(ids, per_prompt, strict=True):
            order.extend(self.add_request(prompt_ids, p, cache_salt=cache_salt, cache=cache))
        final: dict[RequestId, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        failed = next((out for out in final.values() if out.error is not None), None)
        if failed is not None:
            raise RequestFailed(failed.request_id, failed.error or "")
        return [final[rid] for rid in order]
