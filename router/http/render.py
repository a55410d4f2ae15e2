"""Router deltas -> OpenAI JSON: whole responses, server-sent event chunks, usage.

Choices are numbered as OpenAI numbers them: prompt by prompt, `n` each (choice
`prompt * n + sample`). Usage counts each prompt once however many samples it has, and
`prompt_tokens_details.cached_tokens` is the part of the prompt the cache served: for a prompt
with several samples, that of the sample that found least cached (later samples find the first
one's blocks; those were not cached when the request came). Beside it, from that same sample:
`cache_write_tokens` (OpenAI's field: `Usage.cache_write_tokens`) and our extension
`cached_tokens_by_tier` (the tier each cached token came from: "hbm" the device, "dram", "nvme",
"redis", "peer"), so that cached + written + uncached = `prompt_tokens`, and `retained_tokens` /
`retention_trimmed_tokens` (the prompt tokens kept under the retention asked, and those the
tenant's retention budget trimmed: `Usage.retained_tokens`). When the request asked it
(`cache_explain`), `cache_explanation`: that same usage's segments (`router.request.explain`),
each `{start_token, end_token, source, miss_reason}`; with several prompts, each segment also
names its `prompt` (offsets are within it).
"""

from __future__ import annotations

import json
from typing import Any

from router.http.errors import HttpError
from router.http.parse import OpenAIRequest
from router.request.explain import explanation_of
from workers.protocol import StreamDelta, Usage

DONE = b"data: [DONE]\n\n"


class Answer:
    """What a request's deltas add up to; mutated by `add`."""

    def __init__(self, request: OpenAIRequest) -> None:
        self.n = request.n
        self.texts: dict[int, list[str]] = {}
        self.token_ids: dict[int, list[int]] = {}
        self.finish: dict[int, str] = {}
        self._prompt_usage: dict[int, Usage] = {}  # per prompt: its least-cached sample's
        self._completion_tokens = 0

    def add(self, prompt: int, delta: StreamDelta) -> int:
        """Record one delta of prompt `prompt`; returns its choice index."""
        choice = prompt * self.n + delta.index
        if delta.text:
            self.texts.setdefault(choice, []).append(delta.text)
        self.token_ids.setdefault(choice, []).extend(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish[choice] = delta.finish_reason
        if delta.usage is not None:
            u = delta.usage
            known = self._prompt_usage.get(prompt)
            if known is None or u.cache_read_tokens < known.cache_read_tokens:
                self._prompt_usage[prompt] = u
            self._completion_tokens += u.completion_tokens
        return choice

    def prompt_usages(self) -> list[Usage]:
        """Each prompt's usage (that of its sample that found least cached)."""
        return list(self._prompt_usage.values())

    def usage(self) -> dict[str, Any]:
        usages = self.prompt_usages()
        prompt = sum(u.prompt_tokens for u in usages)
        by_tier: dict[str, int] = {}
        for u in usages:
            for tier, n in u.cached_tokens.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        details = {
            "cached_tokens": sum(u.cache_read_tokens for u in usages),
            "cached_tokens_by_tier": {tier: n for tier, n in by_tier.items() if n},
            "cache_write_tokens": sum(u.cache_write_tokens for u in usages),
            "retained_tokens": sum(u.retained_tokens for u in usages),
            "retention_trimmed_tokens": sum(u.retention_trimmed_tokens for u in usages),
        }
        out = {
            "prompt_tokens": prompt,
            "completion_tokens": self._completion_tokens,
            "total_tokens": prompt + self._completion_tokens,
            "prompt_tokens_details": details,
        }
        explanation = self._explanation()
        if explanation is not None:
            out["cache_explanation"] = explanation
        return out

    def _explanation(self) -> list[dict[str, Any]] | None:
        """Each prompt's segments in prompt order; None when no usage carries any."""
        found = {p: explanation_of(u) for p, u in sorted(self._prompt_usage.items())}
        if all(segments is None for segments in found.values()):
            return None
        several = len(found) > 1
        out = []
        for prompt, segments in found.items():
            for s in segments or ():
                seg: dict[str, Any] = {
                    "start_token": s.start_token,
                    "end_token": s.end_token,
                    "source": s.source,
                    "miss_reason": s.miss_reason,
                }
                if several:
                    seg["prompt"] = prompt
                out.append(seg)
        return out

    def text(self, choice: int) -> str:
        return "".join(self.texts.get(choice, ()))


def full_response(
    request: OpenAIRequest, answer: Answer, response_id: str, model: str, created: int
) -> dict[str, Any]:
    """The body of a non-streaming completions or chat response."""
    num_choices = len(request.inputs) * request.n
    choices: list[dict[str, Any]] = []
    for i in range(num_choices):
        choice: dict[str, Any] = {"index": i}
        if request.chat:
            choice["message"] = {"role": "assistant", "content": answer.text(i)}
        else:
            choice["text"] = answer.text(i)
        choice["logprobs"] = None
        choice["finish_reason"] = answer.finish.get(i)
        if request.return_token_ids:
            choice["token_ids"] = answer.token_ids.get(i, [])
        choices.append(choice)
    return {
        "id": response_id,
        "object": "chat.completion" if request.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": answer.usage(),
    }


class StreamChunks:
    """The server-sent events of one streaming response, chunk by chunk."""

    def __init__(self, request: OpenAIRequest, response_id: str, model: str, created: int):
        self.request = request
        self.response_id = response_id
        self.answer = Answer(request)
        kind = "chat.completion.chunk" if request.chat else "text_completion"
        # Every chunk starts alike: its JSON up to the choices, written once.
        head = {"id": response_id, "object": kind, "created": created, "model": model}
        self._head = json.dumps(head)[:-1] + ', "choices": '

    def start(self) -> bytes:
        """Chat streams open with the assistant's role for every choice (as OpenAI and vLLM
        send it); completions streams open with nothing."""
        if not self.request.chat:
            return b""
        num_choices = len(self.request.inputs) * self.request.n
        return b"".join(
            self._event([_choice(i, {"role": "assistant", "content": ""}, True, None)])
            for i in range(num_choices)
        )

    def delta(self, prompt: int, delta: StreamDelta) -> bytes:
        """The chunk of one delta; b"" for a delta that says nothing (no text, not last)."""
        choice = self.answer.add(prompt, delta)
        wanted = delta.text or (self.request.return_token_ids and delta.token_ids)
        if not wanted and delta.finish_reason is None:
            return b""
        if self.request.chat:
            content = {"content": delta.text} if delta.text else {}
            event = _choice(choice, content, True, delta.finish_reason)
        else:
            event = _choice(choice, delta.text, False, delta.finish_reason)
        if self.request.return_token_ids:
            event["token_ids"] = list(delta.token_ids)
        return self._event([event])

    def end(self) -> bytes:
        """The usage chunk when the client asked for it (no choices), then `[DONE]`."""
        if not self.request.include_usage:
            return DONE
        usage = json.dumps(self.answer.usage())
        return f'data: {self._head}[], "usage": {usage}}}\n\n'.encode() + DONE

    def error(self, err: HttpError) -> bytes:
        """An error after the stream started (the status is sent already): an error event,
        then `[DONE]`, as vLLM ends such a stream."""
        payload = {"message": err.message, "type": err.type, "param": None, "code": err.code}
        return f"data: {json.dumps({'error': payload})}\n\n".encode() + DONE

    def _event(self, choices: list[dict[str, Any]]) -> bytes:
        return f"data: {self._head}{json.dumps(choices)}}}\n\n".encode()


def _choice(index: int, body: Any, chat: bool, finish_reason: str | None) -> dict[str, Any]:
    key = "delta" if chat else "text"
    return {"index": index, key: body, "logprobs": None, "finish_reason": finish_reason}
