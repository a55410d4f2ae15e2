"""A fault while handling one request of a step fails that request alone: the others of the
batch go on with the tokens they would have had without it, and nothing leaks.

The fault is injected into each per-request phase of a step in turn: sampling its row, the stop
check, forking its samples, advancing its beams."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_support import (
    BAD,
    GREEDY,
    INNOCENT,
    InjectedError,
    add_innocent,
    check_idle,
    fault_engine,
    fault_prompts,
    run_to_end,
    serve,
)

from workers.engine import sampler as sampler_module
from workers.engine import tracking as tracking_module
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.engine.outputs import RequestFailed
from workers.engine.request import Request
from workers.sampling_params import SamplingParams

POISON_SEED = 666
PROMPTS = fault_prompts(0)


def _arm_sample(monkeypatch: pytest.MonkeyPatch) -> SamplingParams:
    """The bad request's row raises in the sampler at its third token."""
    real, calls = sampler_module._sample_row, [0]

    def row(logits: torch.Tensor, p: SamplingParams, gen: Any) -> int:
        if p.seed == POISON_SEED:
            calls[0] += 1
            if calls[0] == 3:
                raise InjectedError("sampling failed")
        return real(logits, p, gen)

    monkeypatch.setattr(sampler_module, "_sample_row", row)
    return SamplingParams(max_tokens=8, temperature=1.0, seed=POISON_SEED, ignore_eos=True)


def _arm_stop(monkeypatch: pytest.MonkeyPatch) -> SamplingParams:
    """The bad request's stop check raises at its third token (after its token was counted)."""
    real = tracking_module.check_stop

    def check(request: Request, *args: Any) -> Any:
        if request.request_id == BAD and len(request.output_token_ids) == 3:
            raise InjectedError("stop check failed")
        return real(request, *args)

    monkeypatch.setattr(tracking_module, "check_stop", check)
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _arm_fork(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> SamplingParams:
    """The second of the bad request's three samples fails to fork: the request (every
    sample of it) fails."""
    real = engine.forker.fork

    def fork(parent: Request, child_id: Any, params: SamplingParams) -> Request:
        if child_id == f"{BAD}-1":
            raise InjectedError("fork failed")
        return real(parent, child_id, params)

    monkeypatch.setattr(engine.forker, "fork", fork)
    return SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)


def _arm_beam(monkeypatch: pytest.MonkeyPatch, engine: Engine) -> SamplingParams:
    """The bad beam group raises in its third expansion, after it forked beams."""
    real, calls = engine.beams.advance, [0]

    def advance(group: Any, now: float) -> Any:
        if group.public_id == BAD:
            calls[0] += 1
            if calls[0] == 3:
                real(group, now)
                raise InjectedError("beam advance failed")
        return real(group, now)

    monkeypatch.setattr(engine.beams, "advance", advance)
    return SamplingParams(max_tokens=8, beam_width=3, temperature=0.0, ignore_eos=True)


def _arm(phase: str, monkeypatch: pytest.MonkeyPatch, engine: Engine) -> SamplingParams:
    if phase == "sample":
        return _arm_sample(monkeypatch)
    if phase == "stop":
        return _arm_stop(monkeypatch)
    if phase == "fork":
        return _arm_fork(monkeypatch, engine)
    return _arm_beam(monkeypatch, engine)


def _add_innocent(engine: Engine) -> None:
    add_innocent(engine, PROMPTS)


def _check_idle(engine: Engine) -> None:
    check_idle(engine)
    assert not engine.beams.group_of


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[str, tuple[int, ...]]:
    """The innocent requests' tokens in a batch without the bad one."""
    engine = fault_engine(tiny_llama_dir)
    _add_innocent(engine)
    return {rid: out.token_ids for rid, out in run_to_end(engine).items()}


@pytest.mark.parametrize("phase", ["sample", "stop", "fork", "beam"])
def test_a_failing_request_fails_alone(
    tiny_llama_dir: Path,
    reference: dict[str, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    phase: str,
) -> None:
    engine = fault_engine(tiny_llama_dir)
    bad = _arm(phase, monkeypatch, engine)
    _add_innocent(engine)
    bad_ids = engine.add_request(PROMPTS[BAD], bad, request_id=BAD)
    final = run_to_end(engine)
    assert {rid: final[rid].token_ids for rid in reference} == reference
    assert all(final[rid].finish_reason == "length" for rid in reference)
    failed = [out for rid, out in final.items() if rid in bad_ids and out.finish_reason == "error"]
    assert failed, [out.finish_reason for rid, out in final.items() if rid in bad_ids]
    assert all("InjectedError" in (out.error or "") for out in failed)
    _check_idle(engine)
    # The engine serves on, with the same tokens as before.
    _add_innocent(engine)
    assert {rid: out.token_ids for rid, out in run_to_end(engine).items()} == reference
    _check_idle(engine)


def test_generate_raises_once_every_request_is_done(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = fault_engine(tiny_llama_dir)
    bad = _arm_sample(monkeypatch)
    with pytest.raises(RequestFailed, match="InjectedError") as info:
        engine.generate([PROMPTS["greedy"], PROMPTS[BAD]], [GREEDY, bad])
    assert info.value.request_id == "req-1"
    _check_idle(engine)


@pytest.fixture
def async_engine(tiny_llama_dir: Path) -> Iterator[Callable[..., Any]]:
    engine = fault_engine(tiny_llama_dir)
    yield lambda body: serve(engine, body)
    _check_idle(engine)


def test_async_streams_of_the_batch_go_on(
    async_engine: Callable[..., Any],
    reference: dict[str, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bad = _arm_stop(monkeypatch)

    async def collect(aengine: AsyncEngine, name: str, params: SamplingParams) -> Any:
        outs: dict[str, tuple[int, ...]] = {}
        try:
            async for out in aengine.generate(PROMPTS[name], params, request_id=name):
                outs[out.request_id] = out.token_ids
        except RequestFailed as exc:
            return exc
        return outs

    async def body(aengine: AsyncEngine) -> list[Any]:
        streams = [collect(aengine, name, params) for name, params in INNOCENT]
        return await asyncio.gather(*streams, collect(aengine, BAD, bad))

    *innocent, failure = async_engine(body)
    assert isinstance(failure, RequestFailed) and failure.request_id == BAD
    assert "InjectedError" in str(failure)
    merged = {rid: tokens for outs in innocent for rid, tokens in outs.items()}
    assert merged == reference
