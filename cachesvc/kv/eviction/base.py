"""The eviction-policy interface, and the registry that builds a policy by name.

A policy orders the *evictable* keys of one store (the device pool's free blocks, a tier's
blocks) and keeps what it needs of their history while they are in use. The store tells it
what happens to a key; the policy never sees a block's bytes:

* `push`: the key becomes evictable (freed, or stored), as just used;
* `pull`: the key is being used (a hit): it leaves the evictable set if it was in it, and the
  use counts in its history;
* `pop`: the store needs room: the victim leaves, with its history;
* `discard`: the key is gone for another reason (removed, moved down): forgotten entirely.

A key pulled and pushed again is one use. Keys of a store are hashable and need no order among
themselves. Every operation is O(1) amortized, or O(log n) where the policy says so.

A retention class (priority and expiry) composes over this (`classes.ClassedPolicy`): one
policy per class, the lowest class's asked for a victim first; the policy orders within it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from itertools import islice
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """The eviction order of one store's evictable keys (see the module's docstring)."""

    name: str = ""

    @abstractmethod
    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        """Make `key` evictable as just used; `parent` is the key of the block before it in its
        prefix chain (None for a first block, or when unknown). `content` is what the key holds
        where the key is only a slot (a block id holds a hash; None: the key is its content): a
        policy that remembers evicted keys (S3-FIFO's ghost) remembers their content, so the
        same content back in another slot counts as seen again. Mutates."""

    @abstractmethod
    def pull(self, key: K) -> None:
        """`key` is used: no longer evictable (a no-op on the set if it was not in it); the use
        counts in its history. Mutates."""

    @abstractmethod
    def to_front(self, key: K) -> None:
        """Make evictable `key` the very next victim (a copy another store keeps); a policy
        that orders by prefix chains still takes the key's descendants first."""

    @abstractmethod
    def pop(self) -> K:
        """Remove and return the victim; raises IndexError when nothing is evictable."""

    @abstractmethod
    def discard(self, key: K) -> None:
        """Forget `key` and its history, evictable or not; unknown keys are ignored."""

    @abstractmethod
    def __len__(self) -> int:
        """How many keys are evictable."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether `key` is evictable."""

    @abstractmethod
    def __iter__(self) -> Iterator[K]:
        """The evictable keys, the next victim first (where a policy's order depends on the
        victims' history, as S3-FIFO's, an estimate of it). No mutation."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant of the policy's structures is broken."""

    def peek(self, limit: int) -> list[K]:
        """Up to `limit` evictable keys, the next victim first. No mutation."""
        return list(islice(self, limit))


PolicyFactory = Callable[[], EvictionPolicy]  # type: ignore[type-arg]
_MODULES = {
    "lru": "lru",
    "slru": "slru",
    "s3fifo": "s3fifo",
    "leaf_lru": "leaf_first",
    "fanout_lru": "fanout",
}
POLICY_NAMES = tuple(_MODULES)
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    """Class decorator: make a policy constructible by name."""

    def wrap(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def make_policy(name: str) -> EvictionPolicy:  # type: ignore[type-arg]
    """A new, empty policy of `name` (one of POLICY_NAMES); its module is imported on first use.
    Raises ValueError naming the known policies for any other name."""
    if name not in _MODULES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {', '.join(POLICY_NAMES)}")
    if name not in _REGISTRY:
        import importlib

        importlib.import_module(f"cachesvc.kv.eviction.{_MODULES[name]}")
    return _REGISTRY[name]()
