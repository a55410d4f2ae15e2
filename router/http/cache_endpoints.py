"""Explicit cache control on the HTTP door: `POST /v1/cache/prewarm` and
`DELETE /v1/cache/sessions/{id}`, as the gRPC Cache service's Prewarm and CloseSession.

A prewarm body: `model` (optional, as elsewhere), the prompt as `messages` (a chat, as
/v1/chat/completions takes it) or `prompt` (a string or token ids), and the cache controls
`prompt_cache_retention` (OpenAI's `in_memory` or `24h`) or `retention_s` (seconds, at most a
day), `cache_session_id`, `prompt_cache_key`, `cache_salt`. It answers
`{prompt_tokens, cached_tokens, worker_id, retained_tokens, retention_trimmed_tokens}`; closing
a session answers `{session_id, num_blocks_released}`. A tenant's token acts on its own tenant
only (its salt, its quota, its sessions), as on gRPC.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.auth import Caller, tenant_cache_salt
from router.core import Router
from router.domain import InvalidInput, PrewarmInput, PromptInput
from router.http.body import read_json
from router.http.cache_controls import parse_affinity_key, parse_retention, parse_session_id
from router.http.errors import HttpError, error_body
from router.http.fields import check, check_fields, integer, json_object, typed
from router.http.flow import http_error, until_disconnect
from router.http.parse import chat_messages, prompt_list
from router.request.cache_hints import check_retention_s, check_session_id

_MAX_SALT_LEN = 256  # as the completions endpoints'
_PREWARM_FIELDS = frozenset(
    (
        "model",
        "messages",
        "prompt",
        "prompt_cache_retention",
        "retention_s",
        "cache_session_id",
        "prompt_cache_key",
        "cache_salt",
    )
)


def parse_prewarm(body: Any) -> tuple[str | None, PrewarmInput]:
    """The model named (None: not named) and the prewarm a body asks; InvalidInput naming the
    field."""
    body = json_object(body)
    check_fields(body, _PREWARM_FIELDS)
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    check(has_messages or has_prompt, "messages is required, or prompt: the prompt to warm")
    check(not (has_messages and has_prompt), "messages must not be given with prompt: one of them")
    if has_messages:
        prompt = PromptInput(messages=chat_messages(body["messages"]))
    else:
        prompts = prompt_list(body["prompt"])
        check(len(prompts) == 1, "prompt must be one prompt: a string or an array of token ids")
        prompt = prompts[0]
    salt = typed(body, "cache_salt", str, None)
    check(
        salt is None or len(salt) <= _MAX_SALT_LEN,
        f"cache_salt is {len(salt or '')} characters; at most {_MAX_SALT_LEN}",
    )
    check(
        body.get("prompt_cache_retention") is None or body.get("retention_s") is None,
        "retention_s must not be given with prompt_cache_retention: they ask the same",
    )
    seconds = integer(body, "retention_s")
    retention = parse_retention(body) if seconds is None else check_retention_s(seconds)
    return typed(body, "model", str, None), PrewarmInput(
        request_id=f"prewarm-{uuid.uuid4().hex[:16]}",
        prompt=prompt,
        cache_salt=salt,
        retention_s=retention,
        session_id=parse_session_id(body),
        affinity_key=parse_affinity_key(body),
    )


class CacheEndpoints:
    """The cache control endpoints over a started router. `caller` names a request's caller
    (HttpError 401 without a known token); `count(method, status)` counts it in the door's
    metric."""

    def __init__(
        self,
        router: Router,
        model_name: str,
        caller: Callable[[Request], Caller],
        count: Callable[[str, int], None],
    ) -> None:
        self._router = router
        self.model_name = model_name
        self._caller = caller
        self._count = count

    async def prewarm(self, request: Request) -> Response:
        try:
            caller = self._caller(request)
            model, inp = parse_prewarm(await read_json(request))
            if model is not None and model != self.model_name:
                raise HttpError(
                    404,
                    f"The model `{model[:100]}` does not exist: this server serves "
                    f"`{self.model_name}` (GET /v1/models)",
                    code="model_not_found",
                    param="model",
                )
            inp = dataclasses.replace(
                inp,
                cache_salt=tenant_cache_salt(caller.tenant, inp.cache_salt),
                tenant=caller.tenant or "",
            )
            result = await until_disconnect(request.receive, self._router.prewarm(inp))
        except Exception as exc:
            return self._failed("Prewarm", exc)
        self._count("Prewarm", 200)
        return JSONResponse(dataclasses.asdict(result))

    async def close_session(self, request: Request) -> Response:
        try:
            caller = self._caller(request)
            session = check_session_id(request.path_params["session_id"], "session_id")
            if session is None:
                raise InvalidInput("session_id must not be empty")
            released = await self._router.close_session(caller.tenant or "", session)
        except Exception as exc:
            return self._failed("CloseSession", exc)
        self._count("CloseSession", 200)
        return JSONResponse({"session_id": session, "num_blocks_released": released})

    def _failed(self, method: str, exc: Exception) -> Response:
        err = http_error(exc, None)
        self._count(method, err.status)
        headers = {"www-authenticate": "Bearer"} if err.status == 401 else None
        return Response(error_body(err), err.status, headers, media_type="application/json")
