"""`--max-num-seqs`: the engine's default unless asked, passed to the engine's config by
`generate` and `serve`, a value below 1 refused naming the field."""

from __future__ import annotations

import pytest

from cachesvc.app.cli.common import engine_config
from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config
from workers.config import ConfigError, EngineConfig


def test_flag_reaches_the_engine_config() -> None:
    parse = build_parser().parse_args
    default = EngineConfig().max_num_seqs
    assert engine_config(parse(["generate", "--prompt", "hi"])).max_num_seqs == default
    args = parse(["generate", "--prompt", "hi", "--max-num-seqs", "128"])
    assert engine_config(args).max_num_seqs == 128
    assert serve_config(parse(["serve", "--max-num-seqs", "96"])).engine.max_num_seqs == 96


def test_a_value_below_one_names_the_field() -> None:
    args = build_parser().parse_args(["generate", "--prompt", "hi", "--max-num-seqs", "0"])
    with pytest.raises(ConfigError, match="max_num_seqs"):
        engine_config(args)
