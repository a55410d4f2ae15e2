"""A model run that raises fails the request whose input breaks it, and that request alone: the
failed batch's requests run alone, one per step, until the one that fails alone (twice) is
found; the others finish with the tokens of a run without it, and no block leaks. A fault that
passes fails nothing; one that fails every run fails every request, as from a faulty worker.

Faults are injected into the model forward of a real engine: one that breaks on a marker token in
its input (the poisoned request's prompt), one that breaks while a given request decodes, one
that breaks once whatever the batch, and one that breaks every run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
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

from cachesvc.kv.types import RequestId
from workers.engine.async_engine import AsyncEngine
from workers.engine.engine import Engine
from workers.engine.outputs import RequestFailed
from workers.engine.scheduler import SchedulerOutput

PROMPTS = fault_prompts(3)


class Runs:
    """Wraps the engine's model runs: records each run's request ids and whether it raised, and
    raises InjectedError for the runs `poisoned(output)` says."""

    def __init__(self, engine: Engine, poisoned: Callable[[SchedulerOutput], bool]) -> None:
        self.execute = engine.runner.execute
        self.poisoned = poisoned
        self.log: list[tuple[tuple[str, ...], bool]] = []  # (request ids, raised) per run

    def __call__(self, output: SchedulerOutput, *args: Any) -> Any:
        rids = tuple(c.request_id for c in output.chunks)
        try:
            if self.poisoned(output):
                raise InjectedError(f"model run over {rids} failed")
            result = self.execute(output, *args)
        except Exception:
            self.log.append((rids, True))
            raise
        self.log.append((rids, False))
        return result

    @property
    def failed(self) -> list[tuple[str, ...]]:
        return [rids for rids, raised in self.log if raised]


def _wrap(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, poisoned: Callable[[SchedulerOutput], bool]
) -> Runs:
    runs = Runs(engine, poisoned)
    monkeypatch.setattr(engine.runner, "execute", runs)
    return runs


class MarkerModel:
    """The model, except that any input holding `marker` makes the forward raise."""

    def __init__(self, model: Any, marker: int) -> None:
        self.model, self.marker = model, marker

    def __call__(self, token_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        if bool((token_ids == self.marker).any()):
            raise InjectedError("the forward broke on a marker token")
        return self.model(token_ids, *args)  # type: ignore[no-any-return]


def _add_innocent(engine: Engine) -> None:
    add_innocent(engine, PROMPTS)


def _check_idle(engine: Engine) -> None:
    check_idle(engine)
    assert not engine.scheduler.suspects
    engine.scheduler.suspects.check_integrity()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> tuple[dict[str, tuple[int, ...]], int]:
    """The innocent requests' tokens in a batch without the bad one, and a marker: a token id
    that no input of that run held."""
    engine = fault_engine(tiny_llama_dir)
    seen: set[int] = set()
    model = engine.runner.model

    def record(token_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        seen.update(token_ids.tolist())
        return model(token_ids, *args)  # type: ignore[no-any-return]

    engine.runner.model = record  # type: ignore[assignment]
    _add_innocent(engine)
    tokens = {rid: out.token_ids for rid, out in run_to_end(engine).items()}
    marker = min(set(range(3, 320)) - seen - set(PROMPTS[BAD]))
    return tokens, marker


def _arm(
    kind: str, engine: Engine, monkeypatch: pytest.MonkeyPatch, marker: int
) -> tuple[list[int], Runs]:
    """The bad request's prompt, and the runs, poisoned the `kind` way."""
    if kind == "marker":  # its prompt ends on a token the forward cannot take
        monkeypatch.setattr(engine.runner, "model", MarkerModel(engine.runner.model, marker))
        return [*PROMPTS[BAD], marker], _wrap(engine, monkeypatch, lambda _: False)
    limit = len(PROMPTS[BAD]) + 2  # it breaks the forward once it decodes its third token

    def decoding(output: SchedulerOutput) -> bool:
        return any(
            c.request_id == BAD and c.start_pos + len(c.token_ids) > limit for c in output.chunks
        )

    return PROMPTS[BAD], _wrap(engine, monkeypatch, decoding)


@pytest.mark.parametrize("first", [False, True], ids=["bad-last", "bad-first"])
@pytest.mark.parametrize("kind", ["marker", "decode"])
def test_a_poisoned_forward_fails_its_request_alone(
    tiny_llama_dir: Path,
    reference: tuple[dict[str, tuple[int, ...]], int],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    first: bool,
) -> None:
    tokens, marker = reference
    engine = fault_engine(tiny_llama_dir)
    prompt, runs = _arm(kind, engine, monkeypatch, marker)
    if first:
        engine.add_request(prompt, GREEDY, request_id=BAD)
    _add_innocent(engine)
    if not first:
        engine.add_request(prompt, GREEDY, request_id=BAD)
    final = run_to_end(engine)
    assert {rid: final[rid].token_ids for rid in tokens} == tokens
    assert all(final[rid].finish_reason == "length" for rid in tokens)
    assert final[BAD].finish_reason == "error"
    assert "InjectedError" in (final[BAD].error or "")
    # It broke a batch once, then broke twice alone, and was never run again.
    failed = runs.failed
    assert len(failed) == 3 and len(failed[0]) > 1 and failed[1:] == [(BAD,), (BAD,)]
    # From the failed batch to the verdict, the suspects ran one per step.
    start = next(i for i, (_, raised) in enumerate(runs.log) if raised)
    end = max(i for i, (rids, _) in enumerate(runs.log) if BAD in rids)
    assert all(len(rids) == 1 for rids, _ in runs.log[start + 1 : end + 1])
    _check_idle(engine)
    # The engine serves on, with the same tokens as before.
    _add_innocent(engine)
    assert {rid: out.token_ids for rid, out in run_to_end(engine).items()} == tokens
    _check_idle(engine)


def _raises_once(at: int) -> Callable[[SchedulerOutput], bool]:
    count = [0]

    def poisoned(_: SchedulerOutput) -> bool:
        count[0] += 1
        return count[0] == at

    return poisoned


def test_a_transient_fault_in_a_batch_fails_nothing(
    tiny_llama_dir: Path,
    reference: tuple[dict[str, tuple[int, ...]], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens, _ = reference
    engine = fault_engine(tiny_llama_dir)
    runs = _wrap(engine, monkeypatch, _raises_once(3))  # all of them decoding, in one batch
    _add_innocent(engine)
    final = run_to_end(engine)
    assert len(runs.failed) == 1 and len(runs.failed[0]) > 1
    assert {rid: final[rid].token_ids for rid in tokens} == tokens
    assert all(out.finish_reason == "length" for out in final.values())
    _check_idle(engine)


@pytest.mark.parametrize("at", [1, 3], ids=["prefill", "decode"])
def test_a_transient_fault_of_a_lone_request_fails_nothing(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, at: int
) -> None:
    [clean] = fault_engine(tiny_llama_dir).generate([PROMPTS["greedy"]], GREEDY)
    engine = fault_engine(tiny_llama_dir)
    runs = _wrap(engine, monkeypatch, _raises_once(at))
    [out] = engine.generate([PROMPTS["greedy"]], GREEDY)
    assert len(runs.failed) == 1
    assert out.token_ids == clean.token_ids and out.finish_reason == "length"
    _check_idle(engine)


def test_lone_failures_of_two_requests_in_a_row_are_a_worker_fault(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every run fails. A request alone on the worker is blamed once it failed alone twice
    # (nothing told it and the worker apart); the next request failing alone makes it a fault
    # of the worker: the error propagates, as it always did.
    engine = fault_engine(tiny_llama_dir)
    runs = _wrap(engine, monkeypatch, lambda _: True)
    engine.add_request(PROMPTS["greedy"], GREEDY, request_id="first")
    assert engine.step() == []
    [blamed] = engine.step()
    assert blamed.request_id == "first" and blamed.finish_reason == "error"
    engine.add_request(PROMPTS["seeded"], GREEDY, request_id="second")
    with pytest.raises(InjectedError):
        engine.step()
    assert runs.failed == [("first",), ("first",), ("second",)]
    engine.abort(RequestId("second"))  # what AsyncEngine does with the streams
    _check_idle(engine)


async def _collect(aengine: AsyncEngine, name: str, prompt: list[int], params: Any) -> Any:
    """The stream's tokens by request id, or the error it raised."""
    outs: dict[str, tuple[int, ...]] = {}
    try:
        async for out in aengine.generate(prompt, params, request_id=name):
            outs[out.request_id] = out.token_ids
    except Exception as exc:
        return exc
    return outs


async def _all(aengine: AsyncEngine, bad_prompt: list[int] | None = None) -> list[Any]:
    streams = [_collect(aengine, name, PROMPTS[name], params) for name, params in INNOCENT]
    if bad_prompt is not None:
        streams.append(_collect(aengine, BAD, bad_prompt, GREEDY))
    return await asyncio.gather(*streams)


def test_async_streams_of_a_poisoned_batch_go_on(
    tiny_llama_dir: Path,
    reference: tuple[dict[str, tuple[int, ...]], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tokens, marker = reference
    engine = fault_engine(tiny_llama_dir)
    prompt, _ = _arm("marker", engine, monkeypatch, marker)
    *innocent, failure = serve(engine, lambda aengine: _all(aengine, prompt))
    assert isinstance(failure, RequestFailed) and failure.request_id == BAD
    assert "InjectedError" in str(failure)
    assert {rid: t for outs in innocent for rid, t in outs.items()} == tokens
    _check_idle(engine)


def test_async_streams_all_fail_on_a_worker_fault(
    tiny_llama_dir: Path,
    reference: tuple[dict[str, tuple[int, ...]], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every run fails once the batch decodes: the worker is at fault, and every stream raises
    # its error (not RequestFailed: the router may retry them on another worker).
    tokens, _ = reference
    engine = fault_engine(tiny_llama_dir)
    count = [0]

    def broken(_: SchedulerOutput) -> bool:
        count[0] += 1
        return count[0] > 2

    runs = _wrap(engine, monkeypatch, broken)
    results = serve(engine, _all)
    assert all(type(r) is InjectedError for r in results), results
    assert len(runs.failed) == 3  # the batch, then two distinct requests alone
    _check_idle(engine)
    monkeypatch.setattr(engine.runner, "execute", runs.execute)  # the worker is mended
    results = serve(engine, _all)
    assert {rid: t for outs in results for rid, t in outs.items()} == tokens
    _check_idle(engine)
