"""The native kernels' build: a failed build is remembered in its cache folder, not retried."""

from __future__ import annotations

from pathlib import Path

from workers.kernels import build
from workers.kernels.linear import _SOURCE


def test_a_failed_build_is_remembered_and_not_retried(tmp_path: Path) -> None:
    # `false` is a compiler that always fails: the first call records it, the second does not
    # run it again (it would fail the same way), and neither leaves a library behind.
    compiler = "/bin/false"
    assert build.build(_SOURCE, compiler, tmp_path) is None
    log = tmp_path / "build-failed.log"
    assert log.exists()
    log.write_text("recorded")
    assert build.build(_SOURCE, compiler, tmp_path) is None
    assert log.read_text() == "recorded"
    assert not list(tmp_path.glob("*.so"))
