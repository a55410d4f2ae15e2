"""Retention classes over an eviction policy: eviction takes the lowest class first, and a
policy of the chosen kind orders the blocks within each class.

A block's class is its retention's priority (0: unretained, the default); what a retention is
(priority, expiry, a tenant's budget) is the caller's business: it moves a block between classes
with `set_class`, and an expired retention is `set_class(key, 0)`. A block changing class starts
afresh in its new class's order, as just used.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

from cachesvc.kv.eviction.base import EvictionPolicy, K, make_policy


class ClassedPolicy(EvictionPolicy[K]):
    """`num_classes` policies named `policy`, class 0 evicted first. O(classes) per `pop`,
    the inner policy's cost otherwise."""

    def __init__(self, policy: str, num_classes: int) -> None:
        assert num_classes >= 1
        self.name = f"classed_{policy}"
        self._classes: list[EvictionPolicy[K]] = [make_policy(policy) for _ in range(num_classes)]
        self._class_of: dict[K, int] = {}  # keys outside class 0

    def set_class(self, key: K, cls: int) -> None:
        """Put `key` (evictable or in use) in class `cls`; it keeps its place in neither order."""
        if not 0 <= cls < len(self._classes):
            raise ValueError(f"retention class must be in [0, {len(self._classes)}), got {cls}")
        old = self._class_of.get(key, 0)
        if old == cls:
            return
        evictable = key in self._classes[old]
        self._classes[old].discard(key)
        if cls:
            self._class_of[key] = cls
        else:
            del self._class_of[key]
        if evictable:
            self._classes[cls].push(key)

    def lowest_class(self) -> int | None:
        """The lowest class holding an evictable key (the next victim's); None when empty."""
        return next((c for c, policy in enumerate(self._classes) if len(policy)), None)

    def class_of(self, key: K) -> int:
        return self._class_of.get(key, 0)

    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        self._classes[self.class_of(key)].push(key, parent, content)

    def pull(self, key: K) -> None:
        self._classes[self.class_of(key)].pull(key)

    def to_front(self, key: K) -> None:
        self._classes[self.class_of(key)].to_front(key)

    def pop(self) -> K:
        for policy in self._classes:
            if len(policy):
                key = policy.pop()
                self._class_of.pop(key, None)
                return key
        raise IndexError("no evictable key")

    def discard(self, key: K) -> None:
        self._classes[self.class_of(key)].discard(key)
        self._class_of.pop(key, None)

    def check_integrity(self) -> None:
        for policy in self._classes:
            policy.check_integrity()
        assert all(c > 0 for c in self._class_of.values()), "class 0 is kept implicitly"
        for cls, policy in enumerate(self._classes):
            assert all(self.class_of(k) == cls for k in policy), "a key in another class"

    def __len__(self) -> int:
        return sum(len(policy) for policy in self._classes)

    def __contains__(self, key: object) -> bool:
        return any(key in policy for policy in self._classes)

    def __iter__(self) -> Iterator[K]:
        for policy in self._classes:
            yield from policy

    def peek(self, limit: int) -> list[K]:
        out: list[K] = []
        for policy in self._classes:
            if len(out) >= limit:
                break
            out += policy.peek(limit - len(out))
        return out
