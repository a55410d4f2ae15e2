"""StreamProgress: a stream cut at any token and resumed elsewhere gives the client the text of
the whole output (no broken character at the seam), stop strings across the seam, and usage of
the whole stream. Workers are simulated by the engine's own incremental detokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from cachesvc.types import WorkerId
from router.resume import StreamProgress
from workers.actor import StreamDelta, Usage
from workers.model.default_model import default_model_path
from workers.model.detokenizer import IncrementalDetokenizer
from workers.model.tokenizer import Tokenizer

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
