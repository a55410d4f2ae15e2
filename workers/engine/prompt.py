"""What makes a prompt servable: its token ids, checked against the model and the pool."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from workers.text.tokenizer import Tokenizer


class PromptError(ValueError):
    """A prompt the engine cannot serve (empty, too long, bad token ids)."""


def encode_prompt(
    prompt: str | Sequence[int],
    tokenizer: Tokenizer | None,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
    blocks_for: Callable[[int], int],
) -> list[int]:
    """Token ids of a prompt given as text or ids. Raises PromptError when it is empty, has
    ids outside the vocabulary, leaves no room for an output token in the context, or could
    never fit the KV pool of `num_blocks` blocks (`blocks_for(num_tokens)`: how many they take)."""
    if isinstance(prompt, str):
        if not prompt:
            raise PromptError("prompt is empty")
        if tokenizer is None:
            raise PromptError("this model has no tokenizer: give token ids, not text")
        ids = tokenizer.encode(prompt)
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise PromptError("prompt has no tokens")
    if any(t < 0 or t >= vocab_size for t in ids):
        raise PromptError(f"prompt token ids must lie in [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise PromptError(
            f"prompt has {len(ids)} tokens; the model's context is "
            f"{max_model_len} (room for at least one output token needed)"
        )
    if blocks_for(len(ids) + 1) > num_blocks:
        raise PromptError(
            f"prompt of {len(ids)} tokens does not fit the KV pool of {num_blocks} blocks"
        )
    return ids
