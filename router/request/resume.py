"""Mid-stream failover: what a client has received of a stream, and how to continue it elsewhere.

When a worker dies after it started streaming, the router sends the prompt plus the tokens
already sent to another worker, asking for the remaining `max_tokens`, and splices the new
stream onto the old one, so the client sees one uninterrupted stream.

- Greedy decoding continues exactly as the undisturbed run would have (same model, same
  prefix), and so does seeded sampling: the draw of each output token is keyed by the seed and
  the token's index in the whole output, which the new worker is told (`output_offset`).
  Unseeded sampling continues correctly in distribution.
- Each sample of an `n`-sample request is followed on its own (`RequestProgress`): after a cut,
  every unfinished sample continues as its own single-sample request (its seed is `seed + i`,
  as on the worker), all on the new worker, where they share the prompt's cached blocks.
  Beam search does not resume: its beams are only sent when they finish, so a cut before that
  is a plain retry, and a cut after it fails with UNAVAILABLE.
- After a resume the new worker sees the sent tokens as prompt, so the router derives the text
  from the token ids itself (one detokenizer over the whole output: no broken character or lost
  leading space at the seam) and checks the stop strings on the whole text (a stop string
  straddling the seam is still found).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from cachesvc.kv.types import WorkerId
from workers.protocol import StreamDelta, Usage
from workers.sampling_params import SamplingParams
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer


@dataclass
class StreamProgress:
    """One request's stream as the client has received it; mutated by `forward` only."""

    prompt_ids: list[int]
    params: dict[str, Any]  # the request's SamplingParams as plain data
    tokenizer: Tokenizer | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_resumes: int = 0
    ended: bool = False  # the router ended the stream itself (a stop string at the seam)
    finished: bool = False  # the client has this stream's last delta
    _detok: IncrementalDetokenizer | None = None
    _pending_text: str = ""

    @property
    def resumable(self) -> bool:
        """Whether a stream cut here can continue on another worker."""
        return self.params.get("n", 1) == 1 and self.params.get("beam_width", 1) == 1

    @property
    def started(self) -> bool:
        return bool(self.token_ids)

    def next_prompt(self) -> list[int]:
        """What the next worker is asked to continue: the prompt plus every token sent."""
        return self.prompt_ids + self.token_ids

    def next_params(self) -> dict[str, Any]:
        """The sampling parameters for the rest of the stream."""
        if not self.token_ids:
            return self.params
        remaining = self.params["max_tokens"] - len(self.token_ids)
        assert remaining >= 1, "a stream with every token sent has finished"
        # The seeded draws continue where the stream stopped (see SamplingParams.output_offset).
        offset = self.params.get("output_offset", 0) + len(self.token_ids)
        return {**self.params, "max_tokens": remaining, "output_offset": offset}

    def resume(self) -> None:
        """Prepare to splice a new worker's stream onto what was sent (call before it starts)."""
        assert self.resumable
        self.num_resumes += 1
        if self.tokenizer is None:
            return
        self._detok = IncrementalDetokenizer(self.tokenizer)
        # One token at a time, as the worker fed its own: the same text comes out, and the
        # same unfinished character at the end is held back, to come out with the next token.
        primed = "".join(self._detok.add(token) for token in self.token_ids)
        self._pending_text = primed[len(self.text) :] if primed.startswith(self.text) else ""

    def forward(self, delta: StreamDelta, worker: WorkerId) -> StreamDelta:
        """The delta to send the client for `delta` from `worker`; after a resume, with text,
        finish and usage relative to the whole stream. When `ended` is True afterwards the
        router found a stop string: stop reading (closing the stream aborts it on the worker)."""
        if not self.resumable or self.num_resumes == 0:
            self._record(delta.token_ids, delta.text)
            self.finished = delta.finish_reason is not None
            return delta
        text, finish = self._resumed_text(delta)
        self._record(delta.token_ids, text)
        usage = delta.usage
        if finish is not None:
            usage = self._usage(usage, worker)
            self.ended = delta.finish_reason is None
            self.finished = True
        return dataclasses.replace(delta, text=text, finish_reason=finish, usage=usage)

    def _record(self, token_ids: tuple[int, ...], text: str) -> None:
        self.token_ids.extend(token_ids)
        self.text += text

    def _resumed_text(self, delta: StreamDelta) -> tuple[str, str | None]:
        if self._detok is None:  # no tokenizer: the worker has none either, text is empty
            return delta.text, delta.finish_reason
        text = self._pending_text + self._detok.add(delta.token_ids)
        self._pending_text = ""
        before = len(self.text)
        full = self.text + text
        stops = [
            at
            for stop in self.params.get("stop", ())
            if (at := full.find(stop, max(0, before - len(stop) + 1))) >= 0
        ]
        if stops:
            return full[before : min(stops)], "stop"
        if delta.finish_reason is not None:
            text += self._detok.finish()
        return text, delta.finish_reason

    def _usage(self, usage: Usage | None, worker: WorkerId) -> Usage:
        """Usage of the whole stream: the original prompt and every generated token; cached
        and computed tokens are the last worker's."""
        if usage is None:  # the router ended the stream on a stop string
            usage = Usage(0, 0, {}, 0, 0.0, None, worker)
        return dataclasses.replace(
            usage,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.token_ids),
        )


@dataclass(frozen=True)
class Part:
    """One worker request of an attempt: the whole request (`sample` None: deltas carry their
    own sample index) or the rest of one sample (its deltas are re-indexed to `sample`)."""

    sample: int | None
    prompt_ids: list[int]
    params: dict[str, Any]

    @property
    def num_samples(self) -> int:
        return int(self.params.get("n", 1))


class RequestProgress:
    """Every sample of one request as the client has received them."""

    def __init__(self, prompt_ids: list[int], params: dict[str, Any], tokenizer: Tokenizer | None):
        self.prompt_ids = prompt_ids
        self.params = params
        sampling = SamplingParams(**params)
        per_sample = (
            [params]
            if sampling.n == 1
            else [asdict(sampling.for_sample(i)) for i in range(sampling.n)]
        )
        self.samples = [StreamProgress(list(prompt_ids), p, tokenizer) for p in per_sample]
        self.num_resumes = 0  # failovers mid-stream
        self.continued = False  # the samples continue one by one (after a resume or hand-off)

    @property
    def resumable(self) -> bool:
        return all(s.resumable for s in self.samples)

    @property
    def started(self) -> bool:
        return any(s.started for s in self.samples)

    @property
    def ended(self) -> bool:
        """Every sample has finished and the router ended one itself (a stop string at the
        seam): stop reading, the worker does not know (closing the stream aborts it there)."""
        return all(s.finished for s in self.samples) and any(s.ended for s in self.samples)

    def done(self, sample: int) -> bool:
        return self.samples[sample].finished

    def parts(self) -> list[Part]:
        """What to ask the next worker for: the whole request until a resume, then the rest of
        each unfinished sample."""
        if not self.continued:
            return [Part(None, self.prompt_ids, self.params)]
        return [
            Part(i, s.next_prompt(), s.next_params())
            for i, s in enumerate(self.samples)
            if not s.finished
        ]

    def resume(self) -> None:
        """Prepare every unfinished sample to continue on another worker."""
        self.hand_off()
        self.num_resumes += 1

    def hand_off(self) -> None:
        """Prepare every unfinished sample to continue on another worker by design, not by a
        failure (a decode worker after the prefill worker sent the first token): a resume
        that is not counted as one."""
        assert self.resumable
        self.continued = True
        for sample in self.samples:
            if not sample.finished:
                sample.resume()

    def forward(self, part: Part, delta: StreamDelta, worker: WorkerId) -> StreamDelta | None:
        """The delta to send the client; None for what a sample sends after the router ended
        it (a stop string at the seam)."""
        index = delta.index if part.sample is None else part.sample
        sample = self.samples[index]
        if sample.finished:
            return None
        return dataclasses.replace(sample.forward(delta, worker), index=index)
