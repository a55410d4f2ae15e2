"""Runs beam groups over the engine's requests: fork continuing beams, drop the others."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from cachesvc.kv.types import RequestId
from workers.engine.beam import BeamGroup, Candidate, expand
from workers.engine.forking import Forker
from workers.engine.request import FinishReason, Request


class BeamSearch:
    """Owns every live beam group; the engine hands it each beam's logits after a step."""

    def __init__(
        self,
        forker: Forker,
        requests: dict[RequestId, Request],
        drop: Callable[[Request], None],
        max_model_len: int,
    ) -> None:
        self.forker = forker
        self.requests = requests  # the engine's live requests, shared
        self.drop = drop
        self.max_model_len = max_model_len
        self.group_of: dict[RequestId, BeamGroup] = {}
        self._origin: dict[RequestId, Request] = {}  # each group's first request, for its metadata
        self._ids = itertools.count()

    def start(self, request: Request) -> None:
        p = request.params
        group = BeamGroup(request.request_id, p.beam_width, p.length_penalty, p.max_tokens)
        group.beams, group.cum_logprobs = [request.request_id], [0.0]
        self.group_of[request.request_id] = group
        self._origin[request.request_id] = request

    def is_beam(self, rid: RequestId) -> bool:
        return rid in self.group_of

    def on_logits(self, rid: RequestId, logits: torch.Tensor, now: float) -> None:
        origin = self._origin.get(self.group_of[rid].public_id)
        if origin is not None and origin.first_token_time is None:
            origin.first_token_time = now
        self.group_of[rid].pending[rid] = torch.log_softmax(logits.float(), dim=-1)

    def ready_groups(self) -> list[BeamGroup]:
        groups = {id(g): g for g in self.group_of.values()}
        return [g for g in groups.values() if g.ready()]

    def advance(self, group: BeamGroup, now: float) -> Request | None:
        """Expand one step. Returns a finished request carrying the best hypothesis, or None."""
        members = [self.requests[b] for b in group.beams]
        first = members[0]
        eos = () if first.params.ignore_eos else first.eos_token_ids
        lps = [group.pending[b] for b in group.beams]
        keep, finished = expand(group.cum_logprobs, lps, group.width, eos)
        for cand in finished:
            tokens = [*members[cand.parent].output_token_ids, cand.token_id]
            group.add_finished(tokens, cand.cum_logprob, eos=True)
        continuing = self._continue(group, members, keep, now)
        out_len = len(continuing[0].output_token_ids) if continuing else 0
        full = any(r.num_tokens >= self.max_model_len for r in continuing)
        if continuing and not group.done(out_len) and not full:
            return None
        for r, cum in zip(continuing, group.cum_logprobs, strict=True):
            group.add_finished(r.output_token_ids, cum, eos=False)
        return self._finish(group, continuing, now)

    def abort(self, rid: RequestId) -> Request | None:
        """Drop every beam of the group of `rid` (its public id or one of its beams); returns
        the group's first request (its prompt and parameters), None for an unknown id. Safe on
        a group left half-advanced by an error: every request of the group goes."""
        group = self.group_of.get(rid)
        if group is None:
            group = next((g for g in self.group_of.values() if g.public_id == rid), None)
        if group is None:
            return None
        members = {b for b, g in self.group_of.items() if g is group} | set(group.beams)
        for b in sorted(members):
            request = self.requests.get(b)
            if request is not None:
                self._forget(request)
            self.group_of.pop(b, None)
        return self._origin.pop(group.public_id, None)

    def _continue(
        self, group: BeamGroup, members: list[Request], keep: list[Candidate], now: float
    ) -> list[Request]:
        claimed: set[int] = set()
        targets: list[Request] = []
        # Forks first: a fork copies its parent's tokens before the parent takes its own.
        for cand in keep:
            parent = members[cand.parent]
            if cand.parent in claimed:
                rid = RequestId(f"{group.public_id}#beam{next(self._ids)}")
                child = self.forker.fork(parent, rid, parent.params)
                self.requests[rid] = child
                self.group_of[rid] = group
                targets.append(child)
            else:
                claimed.add(cand.parent)
                targets.append(parent)
        for i, member in enumerate(members):
            if i not in claimed:
                self._forget(member)
        for target, cand in zip(targets, keep, strict=True):
            target.append_token(cand.token_id, now)
        group.beams = [t.request_id for t in targets]
        group.cum_logprobs = [c.cum_logprob for c in keep]
        group.pending.clear()
        return targets

    def _finish(self, group: BeamGroup, live: list[Request], now: float) -> Request:
        best = group.finished[0]
        for r in live:
            self._forget(r)
        origin = self._origin.pop(group.public_id)
        result = Request(
            group.public_id,
            list(origin.prompt_token_ids),
            origin.params,
            arrival_time=origin.arrival_time,
            output_token_ids=list(best.token_ids),
            first_token_time=origin.first_token_time or now,
        )
        result.num_cached_tokens = origin.num_cached_tokens
        result.num_preemptions = origin.num_preemptions
        result.finish(FinishReason.STOP if best.ended_by_eos else FinishReason.LENGTH, now)
        return result

    def _forget(self, request: Request) -> None:
        self.group_of.pop(request.request_id, None)
        self.drop(request)
