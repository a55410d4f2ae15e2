"""The Anthropic Messages endpoint, `POST /v1/messages`, beside the OpenAI ones on the same
door: the body becomes one `GenerateInput` (`router.http.messages_parse`), the core's deltas an
Anthropic message or its event stream (`router.http.messages_render`), every refusal Anthropic's
error shape with the status its SDK expects. With cache breakpoints, the part of the prompt up
to the last one is counted in tokens here (one more tokenization) for its retention.

The caller's key comes as Anthropic's SDK sends it (`x-api-key`) or as a bearer token; it is
the same token table as the other endpoints'. As there, the first delta of a stream is awaited
before the response starts, so a refusal still gets its status code, and a client that goes
away cancels the request on its worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncGenerator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from router.auth import Caller, TokenTable, tenant_cache_salt
from router.core import Router
from router.domain import InvalidInput
from router.http.body import read_json
from router.http.errors import HttpError
from router.http.flow import http_error, until_disconnect
from router.http.messages_parse import MessagesRequest, parse_messages
from router.http.messages_render import (
    MessageAnswer,
    MessageEvents,
    error_event,
    error_payload,
    message_body,
)
from router.request.ids import check_header_id
from workers.protocol import StreamDelta

_UNAUTHORIZED = "missing or invalid API key: send the header 'x-api-key: <key>'"
_METHOD = "Messages"  # the requests metric's method label
Deltas = AsyncGenerator[StreamDelta, None]


class MessagesEndpoint:
    """`POST /v1/messages` over a started router; `count(method, status)` counts a request
    in the door's metric."""

    def __init__(
        self,
        router: Router,
        model_name: str,
        tokens: TokenTable | None,
        count: Callable[[str, int], None],
    ) -> None:
        self._router = router
        self.model_name = model_name
        self._tokens = tokens
        self._count = count

    async def handle(self, request: Request) -> Response:
        request_id = request.headers.get("x-request-id")
        try:
            parsed = await self._parse(request)
            request_id = parsed.input.request_id
            message_id = f"msg_{request_id}"
            deltas = self._router.generate(parsed.input)
            if parsed.stream:
                return await self._stream(request, message_id, deltas)
            answer = MessageAnswer()
            await until_disconnect(request.receive, _collect(deltas, answer))
            body = message_body(answer, message_id, self.model_name)
            response = JSONResponse(body, headers=_id_headers(message_id))
        except Exception as exc:
            err = http_error(exc, request_id)
            self._count(_METHOD, err.status)
            return error_response(err)
        self._count(_METHOD, 200)
        return response

    async def _parse(self, request: Request) -> MessagesRequest:
        caller = self._caller(request)
        body = await read_json(request)
        given = request.headers.get("x-request-id")
        if given is not None:
            check_header_id(given, "the x-request-id header")
        parsed = parse_messages(body, given or uuid.uuid4().hex)
        if parsed.model != self.model_name:
            raise HttpError(
                404,
                f"model: `{parsed.model[:100]}` does not exist: this server serves "
                f"`{self.model_name}`",
            )
        salt = tenant_cache_salt(caller.tenant, None)
        inp = dataclasses.replace(
            parsed.input,
            cache_salt=salt,
            tenant=caller.tenant or "",
            retention_tokens=await self._retention_tokens(parsed),
        )
        return dataclasses.replace(parsed, input=inp)

    async def _retention_tokens(self, parsed: MessagesRequest) -> int | None:
        """The tokens up to the last cache breakpoint; None (the whole prompt) when it ends the
        prompt, or when its part of the chat cannot be rendered alone (a template that wants
        the conversation to end otherwise): retaining more is the safe side."""
        if parsed.retention_prefix is None:
            return None
        try:
            return len(await self._router.prompts.encode(parsed.retention_prefix, "messages"))
        except InvalidInput:
            return None

    async def _stream(self, request: Request, message_id: str, deltas: Deltas) -> Response:
        # The first delta before the status: a refusal is then an error status, not an event.
        try:
            first = await until_disconnect(request.receive, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise
        events = MessageEvents(message_id, self.model_name)
        headers = {**_id_headers(message_id), "cache-control": "no-cache"}
        body = self._events(events, first, deltas, message_id)
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)

    async def _events(
        self, events: MessageEvents, first: StreamDelta | None, deltas: Deltas, request_id: str
    ) -> AsyncGenerator[bytes, None]:
        status = 499  # a disconnect cancels this generator: nothing else runs
        try:
            async with contextlib.aclosing(deltas):
                yield events.start() + (b"" if first is None else events.delta(first))
                async for delta in deltas:
                    event = events.delta(delta)
                    if event:
                        yield event
            status = 200
            yield events.end()
        except Exception as exc:
            err = http_error(exc, request_id)
            status = err.status
            yield error_event(err)
        finally:
            self._count(_METHOD, status)

    def _caller(self, request: Request) -> Caller:
        if self._tokens is None:
            return Caller(None)
        key = request.headers.get("x-api-key")
        header = f"Bearer {key}" if key else request.headers.get("authorization", "")
        caller = self._tokens.caller([("authorization", header)])
        if caller is None:
            raise HttpError(401, _UNAUTHORIZED)
        return caller


async def _collect(deltas: Deltas, answer: MessageAnswer) -> None:
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            answer.add(delta)


def _id_headers(message_id: str) -> dict[str, str]:
    return {"request-id": message_id, "x-request-id": message_id}


def error_response(err: HttpError) -> Response:
    """Anthropic's error body with the error's status."""
    body = json.dumps(error_payload(err)).encode()
    return Response(body, err.status, media_type="application/json")
