"""One request never takes down its worker's other requests, on real Ray workers behind both
doors: extreme sampling numbers are refused naming the field (or served greedily), and a request
the engine fails on is answered with that failure alone: not retried on the other worker, the
worker stays healthy and the streams that shared its batch finish with their clean tokens."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from http_support import MODEL_NAME, call, error_of, start_http, stop_http

from proto.cachesvc.v1 import cachesvc_pb2 as pb
from proto.cachesvc.v1 import cachesvc_pb2_grpc as pb_grpc
from router.pool.worker_state import Health

pytestmark = pytest.mark.system
POISON = [7, 7, 7, 7, 7, 7]  # a prompt starting so makes the armed engines raise
# A prompt starting so breaks the armed model forward (unlike POISON, never served and cached).
FORWARD_POISON = [9, 9, 9, 9, 9, 9]
PROMPTS = [[11 + 5 * p + i for i in range(10 + 3 * p)] for p in range(4)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def doors(make_server: Any) -> Iterator[tuple[Any, Any, pb_grpc.InferenceStub]]:
    server = make_server(max_retries=2)
    http = start_http(server)
    yield server, http, pb_grpc.InferenceStub(server.channel())
    stop_http(server, http)


def _grpc_request(ids: list[int], **sampling: Any) -> pb.GenerateRequest:
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **sampling}
    return pb.GenerateRequest(
        prompt=pb.Prompt(token_ids=pb.TokenIds(ids=ids)),
        sampling=pb.SamplingParams(**sampling),
    )


def _tokens(stub: pb_grpc.InferenceStub, ids: list[int], **sampling: Any) -> list[int]:
    return [
        t for m in stub.Generate(_grpc_request(ids, **sampling), timeout=120) for t in m.token_ids
    ]


def _chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello world"}],
        "max_tokens": 6,
        "ignore_eos": True,
        **extra,
    }


def _beside_streams(
    stub: pb_grpc.InferenceStub, poisoned: list[int]
) -> tuple[dict[int, list[int] | grpc.RpcError], grpc.RpcError]:
    """A stream of each of PROMPTS, and `poisoned` sent once they run: what each stream ended
    with (its tokens or its error), and the error `poisoned` was answered with."""
    results: dict[int, list[int] | grpc.RpcError] = {}
    started = threading.Event()

    def one(p: int) -> None:
        try:
            out: list[int] = []
            for message in stub.Generate(_grpc_request(PROMPTS[p]), timeout=120):
                out += message.token_ids
                started.set()
            results[p] = out
        except grpc.RpcError as exc:
            results[p] = exc

    threads = [threading.Thread(target=one, args=(p,)) for p in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    assert started.wait(60)
    with pytest.raises(grpc.RpcError) as info:
        _tokens(stub, poisoned)
    for thread in threads:
        thread.join(120)
    return results, info.value


def _healthy(server: Any) -> bool:
    return all(s.health is Health.HEALTHY for s in server.router.pool.states())


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"beam_width": 2, "length_penalty": 1e308}, "length_penalty"),
        ({"beam_width": 2, "length_penalty": -1e308}, "length_penalty"),
        ({"top_p": 1e-300}, "top_p"),
        ({"max_tokens": 10**12}, "max_tokens"),
    ],
)
def test_http_refuses_numbers_the_engine_cannot_survive(
    doors: tuple[Any, Any, Any], extra: dict[str, Any], field: str
) -> None:
    server, http, _ = doors
    status, _, body = call(http, "POST", "/v1/chat/completions", _chat(**extra))
    assert status == 400, body
    assert error_of(body)["param"] == field
    status, _, body = call(http, "POST", "/v1/chat/completions", _chat(temperature=0))
    assert status == 200, body  # the workers serve on
    assert _healthy(server)


def test_http_non_finite_numbers_are_refused(doors: tuple[Any, Any, Any]) -> None:
    _, http, _ = doors
    for field in ("temperature", "top_p", "length_penalty"):
        # 1e999 is valid JSON that reads as infinity; NaN is no JSON at all.
        for value in ("1e999", "-1e999", "NaN"):
            raw = json.dumps(_chat(beam_width=2, **{field: 0.5})).replace("0.5", value)
            status, _, body = call(http, "POST", "/v1/chat/completions", raw.encode())
            assert status == 400, body
            assert error_of(body)["param"] == (None if value == "NaN" else field), body


def test_a_temperature_that_rounds_to_zero_is_greedy(doors: tuple[Any, Any, Any]) -> None:
    server, http, stub = doors
    texts = []
    for temperature in (0, 1e-300, 5e-324):
        status, _, body = call(http, "POST", "/v1/chat/completions", _chat(temperature=temperature))
        assert status == 200, body
        texts.append(json.loads(body)["choices"][0]["message"]["content"])
    assert texts == [texts[0]] * 3
    # On gRPC temperature and top_p are float32: their smallest values sample greedily too.
    greedy = _tokens(stub, PROMPTS[0])
    assert _tokens(stub, PROMPTS[0], temperature=1.4e-45, seed=3) == greedy
    assert _tokens(stub, PROMPTS[0], temperature=1.0, top_p=1.4e-45, seed=3) == greedy
    assert _healthy(server)


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"temperature": float("nan")}, "sampling.temperature"),
        ({"temperature": float("inf")}, "sampling.temperature"),
        ({"top_p": float("nan")}, "sampling.top_p"),
        ({"top_p": float("inf")}, "sampling.top_p"),
    ],
)
def test_grpc_refuses_non_finite_numbers(
    doors: tuple[Any, Any, pb_grpc.InferenceStub], sampling: dict[str, Any], field: str
) -> None:
    _, _, stub = doors
    with pytest.raises(grpc.RpcError) as info:
        _tokens(stub, PROMPTS[1], **sampling)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert field in (info.value.details() or "")


@pytest.fixture
def armed(worker_pair: dict[str, Any]) -> Iterator[Any]:
    """In both workers' processes, the engine's stop check raises for a poisoned prompt at its
    third token (after a few steps in a batch with the others). Yields a function that says how
    often each worker was hit. (Nested functions: Ray ships them by value, not by module.)"""
    import ray

    poison = list(POISON)

    def arm(worker: Any) -> None:
        from workers.engine import tracking

        real = tracking.check_stop
        worker.poison_hits, worker.real_check_stop = 0, real

        def check(request: Any, *args: Any) -> Any:
            poisoned = request.prompt_token_ids[: len(poison)] == poison
            if poisoned and len(request.output_token_ids) == 3:
                worker.poison_hits += 1
                raise RuntimeError("poisoned request")
            return real(request, *args)

        tracking.check_stop = check

    def disarm(worker: Any) -> None:
        from workers.engine import tracking

        tracking.check_stop = worker.real_check_stop

    def hits(worker: Any) -> int:
        return int(worker.poison_hits)

    actors = list(worker_pair.values())
    ray.get([a.__ray_call__.remote(arm) for a in actors], timeout=60)
    yield lambda: ray.get([a.__ray_call__.remote(hits) for a in actors], timeout=60)
    ray.get([a.__ray_call__.remote(disarm) for a in actors], timeout=60)


def test_a_poisoned_request_fails_alone_and_is_not_retried(
    doors: tuple[Any, Any, pb_grpc.InferenceStub], armed: Any
) -> None:
    server, http, stub = doors
    clean = {p: _tokens(stub, ids) for p, ids in enumerate(PROMPTS)}
    retries = server.router.stats().num_retries
    results, error = _beside_streams(stub, POISON + PROMPTS[0])
    assert error.code() is grpc.StatusCode.INTERNAL
    assert "RuntimeError: poisoned request" in (error.details() or "")
    assert results == clean  # every stream of the batch, on either worker, finished intact
    assert sorted(armed()) == [0, 1]  # it ran once, on one worker: not retried on the other
    # The HTTP door answers it as a 500 that says why.
    poisoned = {"model": MODEL_NAME, "prompt": POISON + PROMPTS[1], "max_tokens": 8}
    status, _, body = call(http, "POST", "/v1/completions", {**poisoned, "temperature": 0})
    assert status == 500, body
    assert "RuntimeError: poisoned request" in error_of(body)["message"]
    assert sum(armed()) == 2
    assert server.router.stats().num_retries == retries
    assert _healthy(server)
    assert _tokens(stub, PROMPTS[2]) == clean[2]


@pytest.fixture
def armed_forward(worker_pair: dict[str, Any]) -> Iterator[Any]:
    """In both workers' processes, the model forward raises whenever its input holds the start
    of a poisoned prompt (its first tokens at positions 0 on): whatever batch it is in. Yields a
    function that says how many model runs each worker's poison broke."""
    import ray

    poison = list(FORWARD_POISON)

    def arm(worker: Any) -> None:
        runner = worker._engine.engine.runner
        model = runner.model
        worker.forward_hits, worker.real_model = 0, model

        def forward(token_ids: Any, positions: Any, *args: Any) -> Any:
            ids = token_ids.tolist()
            starts = (positions == 0).nonzero().flatten().tolist()
            if any(ids[s : s + len(poison)] == poison for s in starts):
                worker.forward_hits += 1
                raise RuntimeError("poisoned forward")
            return model(token_ids, positions, *args)

        runner.model = forward

    def disarm(worker: Any) -> None:
        worker._engine.engine.runner.model = worker.real_model

    def hits(worker: Any) -> int:
        return int(worker.forward_hits)

    actors = list(worker_pair.values())
    ray.get([a.__ray_call__.remote(arm) for a in actors], timeout=60)
    yield lambda: ray.get([a.__ray_call__.remote(hits) for a in actors], timeout=60)
    ray.get([a.__ray_call__.remote(disarm) for a in actors], timeout=60)


def test_a_prompt_that_breaks_the_forward_fails_alone_and_is_not_retried(
    doors: tuple[Any, Any, pb_grpc.InferenceStub], armed_forward: Any
) -> None:
    # The poisoned prompt breaks every model run it is in: its batch's requests run alone on
    # that worker until it is found (it fails alone, twice), and the batch's streams go on.
    server, http, stub = doors
    clean = {p: _tokens(stub, ids) for p, ids in enumerate(PROMPTS)}
    retries = server.router.stats().num_retries
    results, error = _beside_streams(stub, FORWARD_POISON + PROMPTS[0])
    assert error.code() is grpc.StatusCode.INTERNAL
    assert "RuntimeError: poisoned forward" in (error.details() or "")
    assert results == clean  # every stream, on either worker, finished with its clean tokens
    # It broke runs on one worker only (a batch, when it joined one, then twice alone): it was
    # not retried on the other.
    hits = sorted(armed_forward())
    assert hits[0] == 0 and hits[1] in (2, 3), hits
    # The HTTP door answers it as a 500 that says why; alone on a worker it breaks two runs.
    poisoned = {"model": MODEL_NAME, "prompt": FORWARD_POISON + PROMPTS[1], "max_tokens": 8}
    status, _, body = call(http, "POST", "/v1/completions", {**poisoned, "temperature": 0})
    assert status == 500, body
    assert "RuntimeError: poisoned forward" in error_of(body)["message"]
    assert sum(armed_forward()) == sum(hits) + 2
    assert server.router.stats().num_retries == retries
    assert _healthy(server)
    assert _tokens(stub, PROMPTS[2]) == clean[2]
