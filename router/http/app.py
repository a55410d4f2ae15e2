"""The OpenAI-compatible endpoints (a Starlette app) over a started `router.core.Router`, and
Anthropic's Messages endpoint beside them (`router.http.messages`), and the cache control
endpoints (`router.http.cache_endpoints`).

Translate and delegate, as `router/grpc/server.py` does for gRPC: the bearer token names the
caller and its tenant (the same `TokenTable`), the body (`router.http.body`) becomes
`GenerateInput`s (`router.http.parse`), the core's deltas become OpenAI JSON or server-sent
events (`router.http.render`), the core's errors OpenAI error bodies (`router.http.errors`); any
other exception is a 500 that names only its class, logged with its traceback and request id.

A request costs nothing before it is known to be wanted: the token is checked before the body
is read, a declared length over the limit is refused before reading, and the body is read
only up to the limit. The first delta of a stream is awaited before the response starts, so a
refusal (bad input, full, no worker) still gets its status code. A client that goes away (a
closed connection, before or during the answer) cancels the core's stream, which aborts the
request on its worker; one that goes away while sending its body is counted as cancelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.auth import Caller, TokenTable, tenant_cache_salt
from router.core import Router
from router.domain import GenerateInput, PromptInput
from router.http.body import read_json
from router.http.cache_controls import explain_header
from router.http.cache_endpoints import CacheEndpoints
from router.http.errors import STATUS_NAMES, HttpError, error_body
from router.http.flow import http_error, until_disconnect
from router.http.messages import MessagesEndpoint
from router.http.parse import OpenAIRequest, parse_chat, parse_completion
from router.http.render import Answer, StreamChunks, full_response
from router.request.ids import check_header_id
from router.request.streams import merged
from workers.protocol import StreamDelta

_UNAUTHORIZED = "missing or invalid bearer token: send the header 'Authorization: Bearer <token>'"
Deltas = AsyncGenerator[tuple[int, StreamDelta], None]


class OpenAIDoor:
    """The endpoints of one router; `closing` makes `/health` answer 503 (draining)."""

    def __init__(self, router: Router, model_name: str, tokens: TokenTable | None) -> None:
        self._router = router
        self._config = router.config
        self.model_name = model_name
        self._tokens = tokens
        self.closing = False
        self._created = int(time.time())
        messages = MessagesEndpoint(router, model_name, tokens, self._count)
        cache = CacheEndpoints(router, model_name, self._caller, self._count)
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/messages", messages.handle, methods=["POST"]),
                Route("/v1/cache/prewarm", cache.prewarm, methods=["POST"]),
                Route(
                    "/v1/cache/sessions/{session_id:path}", cache.close_session, methods=["DELETE"]
                ),
            ],
            exception_handlers={404: _unrouted, 405: _unrouted},
        )

    async def health(self, request: Request) -> Response:
        """200 while the router is serving (the gRPC health's SERVING), else 503; no token."""
        serving = not self.closing and self._router.is_serving()
        return Response(status_code=200 if serving else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._caller(request)
        except HttpError as err:
            return _error_response(err)
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "cachesvc",
            "max_model_len": self._router.pool.model.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        method = "ChatCompletions" if chat else "Completions"
        request_id = request.headers.get("x-request-id")  # the body's, once it is read
        try:
            parsed, response_id = await self._parse(request, chat)
            request_id = parsed.inputs[0].request_id
            deltas = self._deltas(parsed.inputs)
            if parsed.stream:
                chunks = StreamChunks(parsed, response_id, self.model_name, int(time.time()))
                return await self._stream(request, method, chunks, deltas)
            answer = Answer(parsed)
            await until_disconnect(request.receive, _collect(deltas, answer))
            body = full_response(parsed, answer, response_id, self.model_name, int(time.time()))
            response = JSONResponse(body, headers={"x-request-id": response_id})
        except Exception as exc:
            err = http_error(exc, request_id)
            self._count(method, err.status)
            return _error_response(err)
        self._count(method, 200)
        return response

    async def _parse(self, request: Request, chat: bool) -> tuple[OpenAIRequest, str]:
        """The request and its response id; raises HttpError or the core's InvalidInput."""
        caller = self._caller(request)
        body = await read_json(request)
        given = request.headers.get("x-request-id")
        if given is not None:
            check_header_id(given, "the x-request-id header")
        given = given or uuid.uuid4().hex
        explain = explain_header(request.headers.get("x-cache-explain"))
        if chat:
            max_len = self._router.pool.model.max_model_len
            parsed = parse_chat(body, self._config, given, max_len)
        else:
            parsed = parse_completion(body, self._config, given)
        if parsed.model is not None and parsed.model != self.model_name:
            raise HttpError(
                404,
                f"The model `{parsed.model[:100]}` does not exist: this server serves "
                f"`{self.model_name}` (GET /v1/models)",
                code="model_not_found",
                param="model",
            )
        inputs = [
            dataclasses.replace(
                inp,
                prompt=await self._prompt(parsed, i),
                cache_salt=tenant_cache_salt(caller.tenant, inp.cache_salt),
                tenant=caller.tenant or "",
                explain_cache=inp.explain_cache or explain,
            )
            for i, inp in enumerate(parsed.inputs)
        ]
        prefix = "chatcmpl-" if chat else "cmpl-"
        return dataclasses.replace(parsed, inputs=tuple(inputs)), prefix + inputs[0].request_id

    async def _prompt(self, parsed: OpenAIRequest, i: int) -> PromptInput:
        """Prompt `i` as the core takes it: a text the client asked to tokenize without the
        tokens the model adds to a prompt (`add_special_tokens: false`) is tokenized here."""
        prompt = parsed.inputs[i].prompt
        if parsed.add_special_tokens or prompt.text is None:
            return prompt
        field = "prompt" if len(parsed.inputs) == 1 else f"prompt[{i}]"
        return PromptInput(token_ids=tuple(await self._router.prompts.encode_item(prompt, field)))

    def _deltas(self, inputs: tuple[GenerateInput, ...]) -> Deltas:
        """The core's deltas of every prompt, tagged with the prompt's position."""
        if len(inputs) == 1:
            return _tagged(self._router.generate(inputs[0]))
        streams = {i: self._router.generate(inp) for i, inp in enumerate(inputs)}
        return merged(streams, lambda _: False)

    async def _stream(
        self, request: Request, method: str, chunks: StreamChunks, deltas: Deltas
    ) -> Response:
        # The first delta before the status: a refusal is then an error status, not an event.
        try:
            first = await until_disconnect(request.receive, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise
        events = self._events(method, chunks, first, deltas)
        headers = {"x-request-id": chunks.response_id, "cache-control": "no-cache"}
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _events(
        self,
        method: str,
        chunks: StreamChunks,
        first: tuple[int, StreamDelta] | None,
        deltas: Deltas,
    ) -> AsyncGenerator[bytes, None]:
        status = 499  # a disconnect cancels this generator: nothing else runs
        try:
            async with contextlib.aclosing(deltas):
                yield chunks.start() + (b"" if first is None else chunks.delta(*first))
                async for prompt, delta in deltas:
                    event = chunks.delta(prompt, delta)
                    if event:
                        yield event
            status = 200
            yield chunks.end()
        except Exception as exc:
            err = http_error(exc, chunks.request.inputs[0].request_id)
            status = err.status
            yield chunks.error(err)
        finally:
            self._count(method, status)

    def _caller(self, request: Request) -> Caller:
        if self._tokens is None:
            return Caller(None)
        caller = self._tokens.caller([("authorization", request.headers.get("authorization", ""))])
        if caller is None:
            raise HttpError(401, _UNAUTHORIZED, code="invalid_api_key")
        return caller

    def _count(self, method: str, status: int) -> None:
        name = STATUS_NAMES.get(status, "UNKNOWN")
        self._router.metrics.requests.labels("http", method, name).inc()


async def _tagged(stream: AsyncGenerator[StreamDelta, None]) -> Deltas:
    async with contextlib.aclosing(stream) as deltas:
        async for delta in deltas:
            yield 0, delta


async def _collect(deltas: Deltas, answer: Answer) -> None:
    async with contextlib.aclosing(deltas):
        async for prompt, delta in deltas:
            answer.add(prompt, delta)


async def _unrouted(request: Request, exc: Exception) -> Response:
    """An unknown path (404) or method (405), in OpenAI's error shape like every error."""
    assert isinstance(exc, HTTPException)
    what = "path" if exc.status_code == 404 else "method"
    message = f"{exc.detail}: {request.method} {request.url.path} (no such {what})"
    return _error_response(HttpError(exc.status_code, message))


def _error_response(err: HttpError) -> Response:
    headers = {"www-authenticate": "Bearer"} if err.status == 401 else None
    return Response(error_body(err), err.status, headers, media_type="application/json")
