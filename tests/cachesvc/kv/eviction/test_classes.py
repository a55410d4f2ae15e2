"""Retention classes over a policy: lower classes go first, the policy orders within a class."""

from __future__ import annotations

import pytest

from cachesvc.kv.eviction.classes import ClassedPolicy


def test_a_retained_block_outlives_older_and_newer_unretained_ones() -> None:
    p: ClassedPolicy[str] = ClassedPolicy("lru", num_classes=3)
    p.push("kept")  # least recent of all, but retained
    p.set_class("kept", 2)
    for k in ("a", "b"):
        p.push(k)
    p.push("mid")
    p.set_class("mid", 1)
    assert p.peek(4) == ["a", "b", "mid", "kept"]
    p.check_integrity()
    assert [p.pop() for _ in range(4)] == ["a", "b", "mid", "kept"]


def test_the_policy_orders_within_a_class_and_expiry_returns_to_class_zero() -> None:
    p: ClassedPolicy[str] = ClassedPolicy("slru", num_classes=2)
    for k in ("x", "y", "z"):
        p.set_class(k, 1)  # retained while in use
        p.push(k)
    p.pull("x")  # reused: protected within class 1
    p.push("x")
    p.push("plain")
    p.set_class("z", 0)  # its retention expired: evicted with the unretained, as just used
    assert [p.pop() for _ in range(len(p))] == ["plain", "z", "y", "x"]


def test_membership_follows_the_class_moves() -> None:
    p: ClassedPolicy[int] = ClassedPolicy("s3fifo", num_classes=2)
    p.push(1)
    p.pull(1)
    p.set_class(1, 1)  # in use: no class order holds it
    assert 1 not in p and len(p) == 0
    p.push(1)
    assert 1 in p and p.class_of(1) == 1
    p.discard(1)
    assert p.class_of(1) == 0 and len(p) == 0
    with pytest.raises(ValueError, match="retention class"):
        p.set_class(1, 2)
    with pytest.raises(IndexError):
        p.pop()
