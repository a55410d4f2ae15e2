"""The read arena hands out reused memory only to the borrowing thread, in order, within its
budget; everything else gets a fresh buffer."""

from __future__ import annotations

import threading

from cachesvc.kv.tiers.read_arena import ReadArena


def _same_memory(a: memoryview, b: memoryview) -> bool:
    a[0] = 1
    b[0] = 2
    return a[0] == 2


def test_slots_are_reused_across_borrows_and_grow_when_too_small() -> None:
    arena = ReadArena(capacity_mb=1)
    with arena.borrow():
        a, b = arena.buffer(100), arena.buffer(200)
    with arena.borrow():
        a2, b2 = arena.buffer(50), arena.buffer(300)  # slot 1 is too small: replaced
    assert _same_memory(a, a2) and not _same_memory(b, b2)
    assert len(a2) == 50 and len(b2) == 300 and arena.held_bytes == 400


def test_outside_a_borrow_and_on_other_threads_buffers_are_fresh() -> None:
    arena = ReadArena(capacity_mb=1)
    with arena.borrow():
        mine = arena.buffer(100)
        other: list[memoryview] = []
        thread = threading.Thread(target=lambda: other.append(arena.buffer(100)))
        thread.start()
        thread.join()
    with arena.borrow():
        again = arena.buffer(100)
    outside = arena.buffer(100)
    assert _same_memory(mine, again)
    assert not _same_memory(mine, other[0]) and not _same_memory(again, outside)


def test_the_budget_caps_what_is_held() -> None:
    arena = ReadArena(capacity_mb=1)
    with arena.borrow():
        bufs = [arena.buffer(400_000) for _ in range(4)]  # the third would pass 1 MiB
    assert arena.held_bytes == 800_000
    with arena.borrow():
        again = [arena.buffer(400_000) for _ in range(4)]
    assert _same_memory(bufs[1], again[1]) and not _same_memory(bufs[2], again[2])
