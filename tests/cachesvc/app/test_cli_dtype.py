"""`--dtype`: float32 unless asked, bfloat16 through generate, bench step and a serve config
file, anything else refused naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.app.cli.common import engine_config
from cachesvc.app.cli.main import build_parser, main
from cachesvc.app.cli.serve import serve_config, serve_config_file
from cachesvc.kv.config import ConfigError
from workers.config import EngineConfig
from workers.model.cpu_dtype import cpu_bf16_features
from workers.model.tiny import WordTokenizer, write_tiny_model


def _engine(*argv: str) -> EngineConfig:
    return engine_config(build_parser().parse_args(["generate", "--prompt", "hi", *argv]))


def test_default_is_float32_and_the_flag_sets_bfloat16() -> None:
    assert _engine().dtype == "float32"
    assert _engine("--dtype", "bfloat16").dtype == "bfloat16"
    args = build_parser().parse_args(["bench", "step", "--dtype", "bfloat16", "--quick"])
    assert args.dtype == "bfloat16"


@pytest.mark.parametrize("value", ["bf16", "float16", "int8"])
def test_other_values_are_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--dtype", value])
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(dtype=value if value != "float16" else "float8")


def test_config_file_dtype_holds_unless_the_flag_says_otherwise(tmp_path: Path) -> None:
    path = tmp_path / "serve.yaml"
    path.write_text("engine:\n  dtype: bfloat16\n")
    flags = serve_config(build_parser().parse_args(["serve"]))
    assert serve_config_file(str(path), flags).engine.dtype == "bfloat16"
    flags = serve_config(build_parser().parse_args(["serve", "--dtype", "float32"]))
    # float32 is the default, so the flag cannot outvote the file; any other value does.
    assert serve_config_file(str(path), flags).engine.dtype == "bfloat16"


def test_generate_in_bfloat16(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not cpu_bf16_features():
        pytest.skip("this CPU has no native bfloat16")
    words = WordTokenizer(
        words=["hello", "there"], special=["<eos>", "[UNK]"], unk="[UNK]", eos="<eos>"
    )
    model = write_tiny_model(tmp_path / "tiny", vocab_size=32, tokenizer=words)
    argv = ["generate", "--model", str(model), "--prompt", "hello", "--json", "--dtype"]
    outs = []
    for dtype in ("float32", "bfloat16"):
        assert main([*argv, dtype, "--max-tokens", "4", "--ignore-eos"]) == 0
        outs.append(json.loads(capsys.readouterr().out.splitlines()[-1]))
    assert all(len(o["token_ids"]) == 4 for o in outs)
    assert outs[0]["prompt_token_ids"] == outs[1]["prompt_token_ids"]


def test_serve_refuses_bfloat16_before_ray_starts_on_a_cpu_without_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import cachesvc.app.serve
    from workers.model import cpu_dtype

    # The CPU cannot be changed: the probe answers as a CPU without bf16 would.
    monkeypatch.setattr(cpu_dtype, "cpu_bf16_features", lambda: ())

    def must_not_start(config: object) -> int:
        raise AssertionError("serve started its workers")

    monkeypatch.setattr(cachesvc.app.serve, "run_serve", must_not_start)
    assert main(["serve", "--device", "cpu", "--dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert "native bfloat16" in err and "--dtype float32" in err and err.count("\n") == 1
