"""`--scheme-calibration`: auto unless asked, passed to the engine's and the bench's config,
anything else refused by the parser."""

from __future__ import annotations

import pytest

from cachesvc.app.cli.common import engine_config
from cachesvc.app.cli.main import build_parser
from cachesvc.app.cli.serve import serve_config


def test_engine_flag_reaches_the_config() -> None:
    parse = build_parser().parse_args
    assert engine_config(parse(["generate", "--prompt", "hi"])).scheme_calibration == "auto"
    for mode in ("off", "refresh"):
        args = parse(["generate", "--prompt", "hi", "--scheme-calibration", mode])
        assert engine_config(args).scheme_calibration == mode
    serve = parse(["serve", "--scheme-calibration", "off"])
    assert serve_config(serve).engine.scheme_calibration == "off"


def test_bench_flag_and_a_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    parse = build_parser().parse_args
    args = parse(["bench", "prefill-schemes", "--quick", "--scheme-calibration", "refresh"])
    assert args.scheme_calibration == "refresh"
    with pytest.raises(SystemExit):
        parse(["generate", "--prompt", "hi", "--scheme-calibration", "sometimes"])
    assert "--scheme-calibration" in capsys.readouterr().err
