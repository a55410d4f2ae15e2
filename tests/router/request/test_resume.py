"""StreamProgress: a stream cut at any token and resumed elsewhere gives the client the text of
the whole output (no broken character at the seam), stop strings across the seam, and usage of
the whole stream. Workers are simulated by the engine's own incremental detokenizer."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from cachesvc.kv.types import WorkerId
from router.request.resume import RequestProgress, StreamProgress
from workers.protocol import StreamDelta, Usage
from workers.text.default_model import default_model_path
from workers.text.detokenizer import IncrementalDetokenizer
from workers.text.tokenizer import Tokenizer

TEXT = "Café ☕ crème brûlée, naïve façade — 日本語のテキスト 🙂 and plain words."
W1, W2 = WorkerId("w1"), WorkerId("w2")
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(default_model_path())


def _params(**kw: Any) -> dict[str, Any]:
    return {"max_tokens": 64, "n": 1, "beam_width": 1, "stop": (), **kw}


def _worker(tok: Tokenizer, ids: list[int], worker: WorkerId, total: int) -> list[StreamDelta]:
    """What a worker streams for `ids`: one token per delta, its own detokenizer, usage last."""
    detok = IncrementalDetokenizer(tok)
    out = []
    for i, token in enumerate(ids):
        text = detok.add(token)
        last = i == len(ids) - 1 and total == len(ids)
        usage = Usage(99, len(ids), {"hbm": 8}, 5, 1.0, None, worker) if last else None
        out.append(
            StreamDelta(
                0,
                (token,),
                text + (detok.finish() if last else ""),
                "length" if last else None,
                usage,
            )
        )
    return out


def test_resumed_text_equals_decoding_the_whole_output(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for cut in range(1, len(ids)):
        progress = StreamProgress(list(PROMPT), _params(max_tokens=len(ids)), tokenizer)
        sent = [progress.forward(d, W1) for d in _worker(tokenizer, ids, W1, len(ids))[:cut]]
        progress.resume()
        assert progress.next_prompt() == PROMPT + ids[:cut]
        assert progress.next_params()["max_tokens"] == len(ids) - cut
        rest = _worker(tokenizer, ids[cut:], W2, len(ids) - cut)
        sent += [progress.forward(d, W2) for d in rest]
        assert [t for d in sent for t in d.token_ids] == ids
        assert "".join(d.text for d in sent) == tokenizer.decode(ids), cut
        last = sent[-1]
        assert last.finish_reason == "length" and last.usage is not None
        assert last.usage.prompt_tokens == len(PROMPT)
        assert last.usage.completion_tokens == len(ids)
        assert last.usage.worker_id == W2 and not progress.ended


def test_stop_string_across_the_seam_ends_the_stream(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three STOP four five", add_special_tokens=False)
    stop_at = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[: i + 1]))
    progress = StreamProgress(list(PROMPT), _params(stop=("STOP",)), tokenizer)
    for delta in _worker(tokenizer, ids, W1, 64)[:stop_at]:  # the seam is inside "STOP"
        progress.forward(delta, W1)
    progress.resume()
    out = []
    for delta in _worker(tokenizer, ids[stop_at:], W2, 64):
        out.append(progress.forward(delta, W2))
        if progress.ended:
            break
    assert progress.ended and out[-1].finish_reason == "stop"
    # As in the engine, text already streamed is not taken back; nothing of "STOP" follows.
    sent = progress.text
    assert sent.startswith("one two three") and "STOP" not in sent and out[-1].text == ""
    assert out[-1].usage is not None and out[-1].usage.completion_tokens == stop_at + 1


def test_only_single_sample_streams_resume(tokenizer: Tokenizer) -> None:
    assert not StreamProgress(PROMPT, _params(n=2), tokenizer).resumable
    assert not StreamProgress(PROMPT, _params(beam_width=2), tokenizer).resumable
    progress = StreamProgress(PROMPT, _params(), None)
    delta = StreamDelta(0, (7,), "", None, None)
    assert progress.forward(delta, W1) is delta and progress.started
    progress.resume()
    assert progress.forward(StreamDelta(0, (8,), "x", "length", None), W2).text == "x"


def test_each_unfinished_sample_resumes_on_its_own(tokenizer: Tokenizer) -> None:
    outputs = [
        tokenizer.encode(f"sample {i} says hello", add_special_tokens=False) for i in (0, 1, 2)
    ]
    num = min(len(o) for o in outputs)
    outputs = [o[:num] for o in outputs]
    progress = RequestProgress(list(PROMPT), _params(n=3, seed=5, max_tokens=num), tokenizer)
    [whole] = progress.parts()
    assert whole.sample is None and whole.params["n"] == 3 and whole.num_samples == 3

    # The first worker finishes sample 0, sends two tokens of sample 1, none of sample 2.
    first = [replace(d, index=0) for d in _worker(tokenizer, outputs[0], W1, num)]
    first += [replace(d, index=1) for d in _worker(tokenizer, outputs[1], W1, num)[:2]]
    sent = [progress.forward(whole, d, W1) for d in first]
    assert [d.index for d in sent if d is not None] == [0] * num + [1, 1]
    progress.resume()

    parts = progress.parts()
    assert [p.sample for p in parts] == [1, 2]
    one, two = parts
    assert one.prompt_ids == PROMPT + outputs[1][:2] and two.prompt_ids == PROMPT
    assert (one.params["n"], one.params["seed"], one.params["output_offset"]) == (1, 6, 2)
    assert one.params["max_tokens"] == num - 2
    assert (two.params["n"], two.params["seed"], two.params["max_tokens"]) == (1, 7, num)

    # The second worker streams each part as a one-sample request (index 0).
    rest_one = _worker(tokenizer, outputs[1][2:], W2, num - 2)
    rest_two = _worker(tokenizer, outputs[2], W2, num)
    after = [progress.forward(one, d, W2) for d in rest_one]
    after += [progress.forward(two, d, W2) for d in rest_two]
    assert all(d is not None for d in after)
    for i in (0, 1, 2):
        mine = [d for d in [*sent, *after] if d is not None and d.index == i]
        assert [t for d in mine for t in d.token_ids] == outputs[i]
        assert "".join(d.text for d in mine) == tokenizer.decode(outputs[i])
        assert mine[-1].usage is not None and mine[-1].usage.completion_tokens == num
    assert all(s.finished for s in progress.samples) and not progress.ended


def test_a_sample_ended_at_the_seam_drops_what_its_worker_sends_later(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("one two STOP three four", add_special_tokens=False)
    progress = RequestProgress(list(PROMPT), _params(n=2, stop=("STOP",)), tokenizer)
    [whole] = progress.parts()
    progress.forward(whole, replace(_worker(tokenizer, ids, W1, len(ids))[0], index=1), W1)
    progress.resume()
    part = next(p for p in progress.parts() if p.sample == 1)
    out = [progress.forward(part, d, W2) for d in _worker(tokenizer, ids[1:], W2, len(ids) - 1)]
    kept = [d for d in out if d is not None]
    assert kept[-1].finish_reason == "stop" and "three" not in "".join(d.text for d in kept)
    assert progress.samples[1].finished and out[-1] is None
