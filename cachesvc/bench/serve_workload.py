"""The prompts `cachesvc bench serve` sends: text, so any OpenAI-compatible server takes them.

Pure and deterministic: the same workload, count, seed and sizes give the same prompts in every
process, so two servers (ours, vLLM) answer the same questions and their texts can be compared.
A prompt is words drawn from `WORDS`, common English nouns that are one token each (with their
leading space) in SmolLM2's and Llama's byte-level BPE vocabularies, so N words are about N
tokens; the run reports the token counts the server itself counted.

- `shared-prefix`: one system prompt of `system_words` shared by every request, and a question
  of its own (SGLang's generated-shared-prefix, one group): ~1,075 tokens with the defaults.
- `distinct`: a system prompt and a question of its own per request, nothing shared past the
  chat template's first tokens: ~1,050 tokens with the defaults.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

WORKLOADS = ("shared-prefix", "distinct")
SYSTEM_WORDS = 1000
QUESTION_WORDS = {"shared-prefix": 56, "distinct": 31}
_WORD_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class ServePrompt:
    """One request's prompt: a system message and a user question."""

    system: str
    question: str

    def messages(self) -> list[dict[str, str]]:
        """The chat form (`/v1/chat/completions`)."""
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.question},
        ]

    def text(self) -> str:
        """The plain form (`/v1/completions`): the same words, no chat template."""
        return f"{self.system}\n\n{self.question}\n"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def serve_prompts(
    workload: str,
    num_requests: int,
    seed: int,
    system_words: int = SYSTEM_WORDS,
    question_words: int | None = None,
) -> list[ServePrompt]:
    """`num_requests` prompts of `workload` (one of `WORKLOADS`); `question_words` defaults to
    the workload's (`QUESTION_WORDS`). Raises ValueError for an unknown workload."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {workload!r}")
    if question_words is None:
        question_words = QUESTION_WORDS[workload]
    rng = random.Random(seed)
    shared = _words(rng, system_words)
    prompts = []
    for i in range(num_requests):
        system = shared if workload == "shared-prefix" else _words(rng, system_words)
        prompts.append(ServePrompt(system, f"Question {i}: {_words(rng, question_words)}"))
    return prompts


def warmup_prompt(seed: int, system_words: int = SYSTEM_WORDS) -> ServePrompt:
    """A prompt as long as the workload's that shares no words' order with it (another seed),
    so warming a server up does not put the measured prompts' prefix in its cache."""
    rng = random.Random(f"warmup-{seed}")
    return ServePrompt(_words(rng, system_words), f"Warm up: {_words(rng, 8)}")
