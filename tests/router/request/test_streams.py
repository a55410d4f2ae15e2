"""`merged`: several async streams read as one; a stopped or failed stream closes cleanly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from router.request.streams import merged


def _stream(name: str, items: list[int], closed: list[str], fail_at: int | None = None):
    async def gen() -> AsyncGenerator[int, None]:
        try:
            for i, item in enumerate(items):
                if i == fail_at:
                    raise RuntimeError(f"{name} broke")
                await asyncio.sleep(0)
                yield item
        finally:
            closed.append(name)

    return gen()


def test_every_item_of_every_stream_once() -> None:
    async def main() -> list[tuple[str, int]]:
        closed: list[str] = []
        streams = {k: _stream(k, list(range(5)), closed) for k in "ab"}
        out = [pair async for pair in merged(streams, lambda k: False)]
        assert sorted(closed) == ["a", "b"]
        return out

    out = asyncio.run(main())
    assert sorted(out) == sorted((k, i) for k in "ab" for i in range(5))
    assert [i for k, i in out if k == "a"] == list(range(5))  # each stream keeps its order


def test_a_stopped_stream_is_closed_and_the_others_go_on() -> None:
    async def main() -> list[tuple[str, int]]:
        closed: list[str] = []
        streams = {"a": _stream("a", list(range(100)), closed), "b": _stream("b", [7, 8], closed)}
        seen: list[tuple[str, int]] = []
        async for pair in merged(streams, lambda k: k == "a" and len(seen) >= 3):
            seen.append(pair)
        assert "a" in closed
        return seen

    seen = asyncio.run(main())
    assert [i for k, i in seen if k == "b"] == [7, 8]
    assert len([1 for k, _ in seen if k == "a"]) < 10


def test_an_error_is_raised_and_closes_the_rest() -> None:
    async def main() -> None:
        closed: list[str] = []
        streams = {
            "ok": _stream("ok", list(range(1000)), closed),
            "bad": _stream("bad", [1, 2, 3], closed, fail_at=2),
        }
        with pytest.raises(RuntimeError, match="bad broke"):
            async for _ in merged(streams, lambda k: False):
                pass
        assert sorted(closed) == ["bad", "ok"]

    asyncio.run(main())
