"""Fan-out LRU: a block that leads into several prefix chains is kept longer than one that
serves a single chain.

The `parent` hint says which block comes before a key in its chain, so the policy sees, for
each known key, which block followed it last (the `content` hint names a block held in a
slot). A key whose follower changed at least `min_forks` times is *shared*: it is the prefix
of several conversations (a system prompt, a tool prompt), and so are its ancestors. Shared
keys wait in their own LRU segment, which holds up to `shared_fraction` of the evictable keys;
victims come from the other keys' LRU order first, and from the shared segment only when it
holds more than its share (or nothing else is evictable). A conversation's own blocks serve
it alone: among them recency is all an online policy knows (`docs/benchmarks/eviction.md`),
so they stay in plain LRU order.

A key's history (its last follower, how often that changed, whether it is shared) lasts while
the key is known: from its first `push` to its `pop` or `discard`, in use or not.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

from cachesvc.kv.eviction.base import EvictionPolicy, K, register_policy


@register_policy("fanout_lru")
class FanoutLru(EvictionPolicy[K]):
    """Own and shared segments, each in LRU order; `to_front` keys go before both. Amortized
    O(1): a key is marked shared once per life, and marking walks up only unmarked ancestors."""

    name = "fanout_lru"

    # Both measured (`cachesvc simulate eviction`, all sizes and workloads). One fork also marks
    # prefixes the Mooncake trace shares between a few requests and never again: 0.31 points
    # below LRU at 5% there (32% of the multi-turn gap closed at 1%); two forks (a third chain
    # after the first two, or two chains taking turns) nowhere below LRU (25%); three close
    # less (18%). A share of a quarter closes less at 1% (21%), three quarters no more than half.
    def __init__(self, shared_fraction: float = 0.5, min_forks: int = 2) -> None:
        assert 0 < shared_fraction < 1 and min_forks >= 1
        self.shared_fraction = shared_fraction
        self.min_forks = min_forks
        self._first: OrderedDict[K, None] = OrderedDict()
        self._own: OrderedDict[K, None] = OrderedDict()
        self._shared_queue: OrderedDict[K, None] = OrderedDict()
        self._known: set[K] = set()  # pushed and not yet popped or discarded
        # Chain links between known keys, both ways: a key forgotten takes its links along,
        # so a slot handed to another block is never walked as an old chain's ancestor.
        self._parent: dict[K, K] = {}  # known key -> the known key before it in its chain
        self._children: dict[K, set[K]] = {}  # known key -> the known keys naming it parent
        self._follower: dict[K, Hashable] = {}  # known key -> the block last pushed after it
        self._forks: dict[K, int] = {}  # known key -> how often its follower changed
        self._shared: set[K] = set()

    def push(self, key: K, parent: K | None = None, content: Hashable = None) -> None:
        self._unlink(key)
        self._known.add(key)
        if parent is not None and parent != key and parent in self._known:
            self._link(key, parent)
            # A slot's content names the block: the same block back in another slot is the
            # same follower, another block in a reused slot is not.
            self._note_follower(parent, key if content is None else content)
        (self._shared_queue if key in self._shared else self._own)[key] = None

    def _link(self, key: K, parent: K) -> None:
        old = self._parent.get(key)
        if old is not None and old != parent:
            self._unlink_child(key, old)
        self._parent[key] = parent
        self._children.setdefault(parent, set()).add(key)

    def _unlink_child(self, key: K, parent: K) -> None:
        children = self._children[parent]
        children.discard(key)
        if not children:
            del self._children[parent]

    def _note_follower(self, parent: K, follower: Hashable) -> None:
        last = self._follower.get(parent, follower)
        self._follower[parent] = follower
        if last != follower:
            self._forks[parent] = self._forks.get(parent, 0) + 1
            if self._forks[parent] >= self.min_forks:
                self._mark_shared(parent)

    def _mark_shared(self, key: K | None) -> None:
        """Mark `key` and its known ancestors shared, moving the evictable ones to the shared
        segment's recent end (they were just extended); stops at the first marked already."""
        while key is not None and key not in self._shared:
            self._shared.add(key)
            if self._own.pop(key, 1) is None:  # stored values are None: found and removed
                self._shared_queue[key] = None
            key = self._parent.get(key)

    def pull(self, key: K) -> None:
        self._unlink(key)

    def to_front(self, key: K) -> None:
        self._unlink(key)
        self._first[key] = None
        self._first.move_to_end(key, last=False)

    def pop(self) -> K:
        if self._first:
            key = self._first.popitem(last=False)[0]
        elif self._shared_next(len(self._own), len(self._shared_queue)):
            key = self._shared_queue.popitem(last=False)[0]
        elif self._own:
            key = self._own.popitem(last=False)[0]
        else:
            raise IndexError("no evictable key")
        self._forget(key)
        return key

    def _shared_next(self, num_own: int, num_shared: int) -> bool:
        """Whether the next victim comes from the shared segment, when the segments hold
        these many keys and no `to_front` key is left."""
        total = num_own + num_shared
        return num_shared > 0 and (num_shared > self.shared_fraction * total or not num_own)

    def discard(self, key: K) -> None:
        self._unlink(key)
        self._forget(key)

    def _forget(self, key: K) -> None:
        """Drop `key`'s history and its chain links, both ways. O(its children): each link
        was made by one `push`."""
        self._known.discard(key)
        parent = self._parent.pop(key, None)
        if parent is not None:
            self._unlink_child(key, parent)
        for child in self._children.pop(key, ()):
            del self._parent[child]
        self._follower.pop(key, None)
        self._forks.pop(key, None)
        self._shared.discard(key)

    def _unlink(self, key: K) -> None:
        for queue in (self._first, self._own, self._shared_queue):
            if queue.pop(key, 1) is None:  # stored values are None: found and removed
                return

    def __len__(self) -> int:
        return len(self._first) + len(self._own) + len(self._shared_queue)

    def __contains__(self, key: object) -> bool:
        return key in self._first or key in self._own or key in self._shared_queue

    def __iter__(self) -> Iterator[K]:
        """The exact victim order: `pop`'s choice between the segments replayed on counts."""
        yield from self._first
        own, shared = iter(self._own), iter(self._shared_queue)
        num_own, num_shared = len(self._own), len(self._shared_queue)
        while num_own or num_shared:
            if self._shared_next(num_own, num_shared):
                num_shared -= 1
                yield next(shared)
            else:
                num_own -= 1
                yield next(own)

    def check_integrity(self) -> None:
        queues = (self._first, self._own, self._shared_queue)
        keys = [k for queue in queues for k in queue]
        assert len(keys) == len(set(keys)), "a key in two segments"
        assert self._known.issuperset(keys), "an evictable key unknown"
        assert self._shared.issuperset(self._shared_queue), "an unshared key in the shared segment"
        assert not self._shared.intersection(self._own), "a shared key in the own segment"
        assert self._shared.issubset(self._known), "a forgotten key still shared"
        for history in (self._parent, self._children, self._follower, self._forks):
            assert self._known.issuperset(history), "the history of a forgotten key"
        assert self._known.issuperset(self._parent.values()), "a link to a forgotten key"
        links = {(c, p) for p, children in self._children.items() for c in children}
        assert links == set(self._parent.items()), "the chain links disagree"
        assert all(n >= 1 for n in self._forks.values())
