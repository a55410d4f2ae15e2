"""The JSON request log: one object per line with the `extra` fields; configure_logging keeps
other handlers and follows a swapped stderr."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest

from router.logs import JsonFormatter, configure_logging


def test_json_lines_carry_extra_fields() -> None:
    record = logging.LogRecord(
        "router.requests", logging.INFO, "f.py", 1, "request %s", ("done",), None
    )
    record.request_id = "req-1"
    record.cached_tokens = 48
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request done" and line["level"] == "info"
    assert line["request_id"] == "req-1" and line["cached_tokens"] == 48
    assert line["logger"] == "router.requests" and "T" in line["ts"]


def test_configure_logging_writes_to_the_current_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        configure_logging("json")
        configure_logging("json")  # replaces its own handler, keeps the others

        def ours(h: logging.Handler) -> bool:
            return type(h).__name__ == "_StderrHandler"

        assert sum(map(ours, root.handlers)) == 1
        assert [h for h in root.handlers if not ours(h)] == [h for h in before if not ours(h)]
        stream = io.StringIO()
        monkeypatch.setattr(sys, "stderr", stream)
        logging.getLogger("router.requests").info("hello", extra={"request_id": "r"})
        assert json.loads(stream.getvalue().splitlines()[-1])["request_id"] == "r"
        with pytest.raises(ValueError, match="json or text"):
            configure_logging("xml")
    finally:
        root.handlers[:] = before
        root.setLevel(level)
