"""A Score request (`Router.score`): its prefix and items encoded and checked, the worker chosen
by the prefix's blocks, another tried when that one dies.

The router (`core.Router`) delegates here; the gRPC servicer reaches it through it.
"""

from __future__ import annotations

import dataclasses

from cachesvc.kv.types import WorkerId
from router.domain import InvalidInput, ScoreInput, ScoreResult, Unavailable
from router.pool.worker_errors import WorkerDied, raise_stream_error
from router.pool.worker_pool import WorkerPool
from router.request.placement import Placement
from router.request.prompts import Prompts
from workers.protocol import StreamError


async def score(
    req: ScoreInput, prompts: Prompts, placement: Placement, pool: WorkerPool, max_retries: int
) -> ScoreResult:
    """Per item, the log-probs of the label tokens after prefix + item. Raises InvalidInput
    naming the bad field, the worker's refusal as `raise_stream_error` does, and Unavailable
    when no live worker answered in `max_retries + 1` tries."""
    req = dataclasses.replace(req, cache_salt=prompts.salt(req.cache_salt))
    prefix, items = await _encode(req, prompts, pool.model.max_model_len)
    excluded: set[WorkerId] = set()
    for _ in range(max_retries + 1):
        hashes = prompts.block_hashes(prefix, req.cache_salt)
        decision = placement.route(len(prefix), hashes, excluded).decision
        try:
            result = await pool.call(
                decision.worker, "score", prefix, items, list(req.label_token_ids)
            )
        except WorkerDied as exc:
            excluded.add(exc.worker)
            continue
        if isinstance(result, StreamError):
            raise_stream_error(result)
        logprobs = tuple(tuple(float(x) for x in row) for row in result)
        return ScoreResult(logprobs, decision.worker)
    raise Unavailable("no live worker could score the request")


async def _encode(
    req: ScoreInput, prompts: Prompts, limit: int
) -> tuple[list[int], list[list[int]]]:
    """The prefix's and each item's token ids; raises InvalidInput naming the bad field (an
    empty list, a label outside the vocabulary, a prefix + item beyond the context `limit`)."""
    prefix = await prompts.encode(req.prefix, "prefix")
    if not req.items:
        raise InvalidInput("items must not be empty")
    items = [await prompts.encode_item(item, f"items[{i}]") for i, item in enumerate(req.items)]
    if not req.label_token_ids:
        raise InvalidInput("label_token_ids must not be empty")
    prompts.check_vocab(req.label_token_ids, "label_token_ids")
    for i, item in enumerate(items):
        if len(prefix) + len(item) > limit:
            raise InvalidInput(f"prefix + items[{i}] exceed the model's context of {limit}")
    return prefix, items
