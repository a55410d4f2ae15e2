"""`cachesvc bench serve`'s pure parts: its prompts (shared or not, the same for a seed, about a
token a word), its figures from answers, the text comparison, and its flags refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.app.cli.main import main
from cachesvc.bench.serve import (
    ServeBenchArgs,
    compare_texts,
    load_comparable,
    summarize,
)
from cachesvc.bench.serve_client import Answer, OpenAIServer
from cachesvc.bench.serve_workload import serve_prompts, warmup_prompt


def test_shared_prefix_prompts_share_the_system_prompt_and_nothing_else() -> None:
    prompts = serve_prompts("shared-prefix", 5, seed=3)
    assert len({p.system for p in prompts}) == 1
    assert len({p.question for p in prompts}) == 5
    assert len(prompts[0].system.split()) == 1000
    assert prompts == serve_prompts("shared-prefix", 5, seed=3), "the seed decides the prompts"
    assert prompts[0].system != serve_prompts("shared-prefix", 1, seed=4)[0].system


def test_distinct_prompts_share_no_system_prompt() -> None:
    prompts = serve_prompts("distinct", 5, seed=3, system_words=50, question_words=7)
    assert len({p.system for p in prompts}) == 5
    assert all(len(p.question.split()) == 7 + 2 for p in prompts)  # "Question i:" and 7 words
    assert warmup_prompt(3, 50).system not in {p.system for p in prompts}


def test_an_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="workload"):
        serve_prompts("mixed", 1, seed=0)


def test_words_are_about_a_token_each_in_smollm2() -> None:
    from workers.text.default_model import default_model_path
    from workers.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(default_model_path())
    (prompt,) = serve_prompts("shared-prefix", 1, seed=0)
    ids = tokenizer.encode(tokenizer.apply_chat_template(prompt.messages()))
    assert 1050 <= len(ids) <= 1100, "~1,075 tokens"
    (other,) = serve_prompts("distinct", 1, seed=0)
    assert 1030 <= len(tokenizer.encode(tokenizer.apply_chat_template(other.messages()))) <= 1070


def _answer(index: int, text: str, ttft: float, gaps: list[float]) -> Answer:
    last = ttft + sum(gaps)
    return Answer(index, True, "", text, 100, 60, len(gaps) + 1, 0.0, ttft, last + 0.01, last, gaps)


def test_summary_figures_from_answers() -> None:
    answers = [_answer(0, "a", 0.1, [0.02, 0.04]), _answer(1, "b", 0.3, [0.06, 0.08])]
    answers.append(Answer(2, error="HTTP 500"))
    s = summarize(answers, duration_s=2.0)
    assert (s.num_requests, s.num_ok, s.output_tokens) == (3, 2, 6)
    assert s.requests_per_s == 1.0 and s.output_tokens_per_s == 3.0
    assert s.cached_tokens == 120 and s.prompt_tokens_mean == 100
    assert s.itl_mean_ms == pytest.approx(50.0)
    assert s.tpot_mean_ms == pytest.approx(50.0)  # (0.06 / 2 + 0.14 / 2) / 2 seconds
    assert s.ttft_p50_ms == pytest.approx(200.0)


def test_compare_counts_same_texts_and_refuses_other_prompts(tmp_path: Path) -> None:
    args = ServeBenchArgs(url="http://x", seed=1, compare=str(tmp_path / "other.json"))
    other = {
        "label": "vllm",
        "args": {"workload": "shared-prefix", "seed": 1, "system_words": 1000,
                 "question_words": None, "api": "chat", "max_tokens": 32},
        "answers": [{"index": 0, "text": "same"}, {"index": 1, "text": "theirs"}],
    }  # fmt: skip
    (tmp_path / "other.json").write_text(json.dumps(other))
    loaded = load_comparable(args)
    assert loaded is not None
    mine = [_answer(0, "same", 0.1, [0.1]), _answer(1, "mine", 0.1, [0.1]), Answer(2)]
    result = compare_texts(mine, loaded, str(tmp_path / "other.json"))
    assert (result["compared"], result["same_text"], result["differ"]) == (2, 1, [1])
    assert result["both_answered"] == 2
    loaded["answers"].append({"index": 2, "text": "", "ok": True})
    result = compare_texts(mine, loaded, str(tmp_path / "other.json"))
    assert (result["compared"], result["both_answered"], result["differ"]) == (3, 2, [1, 2])
    other["args"]["seed"] = 2  # type: ignore[index]
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="other prompts"):
        load_comparable(args)


def test_the_body_is_greedy_streamed_and_never_stops_early() -> None:
    (prompt,) = serve_prompts("distinct", 1, seed=0, system_words=4)
    chat = OpenAIServer("http://127.0.0.1:1", "chat", "m", 32).body(prompt)
    assert chat["temperature"] == 0 and chat["ignore_eos"] is True and chat["max_tokens"] == 32
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["messages"][0] == {"role": "system", "content": prompt.system}
    plain = OpenAIServer("http://127.0.0.1:1", "completions", "m", 32).body(prompt)
    assert plain["prompt"].startswith(prompt.system) and "messages" not in plain


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--num-requests", "0"], "--num-requests"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--url", "ftp://host"], "--url"),
    ],
)
def test_bad_flags_are_refused_by_name(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "serve", "--url", "http://127.0.0.1:1", "--model", "m", "--warmup", "0"]
    assert main([*argv, *flags]) == 2
    assert named in capsys.readouterr().err
