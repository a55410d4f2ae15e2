"""What the step benches' command lines share."""

from __future__ import annotations


def int_list(text: str) -> tuple[int, ...]:
    """A flag's comma-separated integers: "1,4,16" -> (1, 4, 16)."""
    return tuple(int(part) for part in text.split(","))
