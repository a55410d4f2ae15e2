"""A request's prompt as the workers will see it: token ids (text, chat or ids, validated) and
the rolling block hashes the workers store their KV under (the routing key is the storage key).

Long texts are tokenized off the event loop (`router/request/prompt_encoder.py`). A request's salt
takes the purge epoch once, when it arrives (`Prompts.salt`): it keeps its hashes for its whole
life, retries and resumes included, and a request that arrives after a purge has new ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cachesvc.kv.hashing import epoch_salt, hash_blocks, root_hash, unshared_salt
from cachesvc.kv.index import PurgeEpochUnknown
from cachesvc.kv.types import BlockHash
from router.domain import GenerateInput, InvalidInput, PromptInput
from router.pool.worker_pool import WorkerPool
from router.request.prompt_encoder import PromptEncoder
from workers.sampling_params import SamplingParams
from workers.text.tokenizer import Tokenizer, TokenizerError


class Prompts:
    """Encodes prompts for the pool's model; `start` once the model is known, `close` at the
    end (it owns the tokenizing threads)."""

    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer | None) -> None:
        self._pool = pool
        self.tokenizer = tokenizer
        self._encoder: PromptEncoder | None = None

    def start(self) -> None:
        if self.tokenizer is not None:
            self._encoder = PromptEncoder(self.tokenizer, self._pool.model.max_model_len)

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()

    async def encode(self, prompt: PromptInput, field: str = "prompt") -> list[int]:
        """Token ids of a prompt as the worker will see them; raises InvalidInput naming the
        field (empty, ids outside the vocabulary, longer than the model's context). Long
        texts are tokenized off the event loop (`PromptEncoder`). A chat's rendered template
        is tokenized without adding special tokens, as vLLM's chat path does: the template
        writes them (a bos added again would be doubled)."""
        if prompt.token_ids is not None:
            ids = list(prompt.token_ids)
            self.check_vocab(ids, f"{field}.token_ids")
        else:
            text = self.render(prompt, field)
            ids = await self._encode_text(text, field, special=prompt.text is not None)
        if not ids:
            raise InvalidInput(f"{field} has no tokens")
        limit = self._pool.model.max_model_len
        if len(ids) >= limit:
            raise InvalidInput(
                f"{field} has {len(ids)} tokens; the model's context is {limit} "
                "(room for at least one output token needed)"
            )
        return ids

    def fit(self, ids: Sequence[int], req: GenerateInput) -> SamplingParams:
        """The request's sampling parameters for a prompt of `ids`: a `max_tokens` the client
        set that does not fit the context with the prompt is refused (InvalidInput naming
        max_tokens, in vLLM's words); a default one is lowered to what fits."""
        params, limit = req.params, self._pool.model.max_model_len
        room = limit - len(ids)  # >= 1: encode() refused a prompt that fills the context
        if params.max_tokens <= room:
            return params
        if not req.max_tokens_set:
            return dataclasses.replace(params, max_tokens=room)
        where = "messages" if req.prompt.messages is not None else "prompt"
        raise InvalidInput(
            f"max_tokens is too large: this model's maximum context length is {limit} tokens. "
            f"However, you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the "
            f"{where}, {params.max_tokens} in the completion). Please reduce the length of the "
            f"{where} or completion."
        )

    def render(self, prompt: PromptInput, field: str = "prompt") -> str:
        """The text a text or chat prompt is tokenized from (the chat template applied)."""
        kind = "text" if prompt.text is not None else "chat"
        if self.tokenizer is None:
            raise InvalidInput(f"{field}.{kind}: this model has no tokenizer; send token_ids")
        if prompt.text is not None:
            if not prompt.text:
                raise InvalidInput(f"{field}.text must not be empty")
            return prompt.text
        messages = [{"role": m.role, "content": m.content} for m in prompt.messages or ()]
        if not messages:
            raise InvalidInput(f"{field}.chat.messages must not be empty")
        try:
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=prompt.add_generation_prompt
            )
        except TokenizerError as exc:
            raise InvalidInput(f"{field}.chat: {exc}") from exc

    async def _encode_text(self, text: str, field: str, special: bool = True) -> list[int]:
        assert self._encoder is not None  # render() checked there is a tokenizer
        return await self._encoder.encode(text, field, add_special_tokens=special)

    def check_vocab(self, ids: Sequence[int], field: str) -> None:
        """Raise InvalidInput naming `field[i]` for the first id outside the vocabulary."""
        vocab = self._pool.model.vocab_size
        for i, token in enumerate(ids):
            if not 0 <= token < vocab:
                raise InvalidInput(f"{field}[{i}] = {token} is outside the vocabulary [0, {vocab})")

    def salt(self, cache_salt: str | None) -> str | None:
        """The salt a request arriving now is hashed under, by this router and the workers:
        its own (tenant) salt at the current purge epoch (read from the index, which routers
        sharing it agree on). When the epoch cannot be read, a salt of this request alone:
        one of the last epoch read could reach blocks another router has purged since."""
        try:
            return epoch_salt(cache_salt, self._pool.index.purge_epoch())
        except PurgeEpochUnknown:  # counted and logged by the index
            return unshared_salt(cache_salt)

    def block_hashes(self, ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """The rolling hashes of the full blocks, exactly as the workers store them;
        `cache_salt` is the request's `salt`."""
        model = self._pool.model
        root = root_hash(model.model_fingerprint, model.block_size, cache_salt or "")
        return hash_blocks(ids, model.block_size, root)

    async def tokenize(
        self, prompt: PromptInput, continuation: bool = False
    ) -> tuple[list[int], int, str]:
        """Token ids, the number of full blocks they make, and the text they came from ("" for
        a token-id prompt). A `continuation` text is encoded as Score encodes items: without
        the tokens the model adds to a prompt."""
        if continuation and prompt.text is not None:
            ids = await self.encode_item(prompt, "prompt")
            return ids, len(ids) // self._pool.model.block_size, prompt.text
        ids = await self.encode(prompt)
        text = "" if prompt.token_ids is not None else self.render(prompt)
        return ids, len(ids) // self._pool.model.block_size, text

    async def encode_item(self, item: PromptInput, field: str) -> list[int]:
        """Token ids of a Score item (or a continuation): without the tokens the model adds
        to a prompt; raises InvalidInput naming the field."""
        if item.token_ids is not None:
            ids = list(item.token_ids)
            self.check_vocab(ids, f"{field}.token_ids")
        elif item.text and self.tokenizer is not None:
            ids = await self._encode_text(item.text, field, special=False)
        else:
            raise InvalidInput(f"{field} must be non-empty text or token_ids")
        if not ids:
            raise InvalidInput(f"{field} has no tokens")
        return ids
