"""Eviction policies: each one's order on small hand-built sequences, scan resistance,
leaf-first and fan-out order, and the interface's contract under random operations."""

from __future__ import annotations

import random
from collections.abc import Sequence
from copy import deepcopy

import pytest

from cachesvc.kv.eviction.base import POLICY_NAMES, EvictionPolicy, make_policy


class Store:
    """A store of `capacity` keys as the device pool uses a policy: a request takes its keys
    (a held key is pulled, a new one evicts a victim when full), then frees them tail first,
    each with the key before it as parent."""

    def __init__(self, policy: str, capacity: int) -> None:
        self.policy: EvictionPolicy[str] = make_policy(policy)
        self.capacity = capacity
        self.held: set[str] = set()

    def request(self, keys: Sequence[str]) -> int:
        """Serve one request; how many leading keys were held (its prefix hit)."""
        hits = 0
        while hits < len(keys) and keys[hits] in self.held:
            hits += 1
        for key in keys:
            if key in self.held:
                self.policy.pull(key)
                continue
            if len(self.held) >= self.capacity:
                self.held.discard(self.policy.pop())
            self.held.add(key)
        for i in reversed(range(len(keys))):
            self.policy.push(keys[i], keys[i - 1] if i else None)
        return hits


def _pop_all(policy: EvictionPolicy[str]) -> list[str]:
    return [policy.pop() for _ in range(len(policy))]


def test_lru_evicts_least_recently_pushed_and_to_front_first() -> None:
    p: EvictionPolicy[str] = make_policy("lru")
    for k in "abcd":
        p.push(k)
    p.pull("b")
    p.push("b")
    p.to_front("d")
    assert _pop_all(p) == ["d", "a", "c", "b"]


def test_slru_takes_probation_before_protected() -> None:
    p: EvictionPolicy[str] = make_policy("slru")
    for k in "abcd":
        p.push(k)
    p.pull("a")  # used again: protected once pushed back
    p.push("a")
    assert _pop_all(p) == ["b", "c", "d", "a"]  # LRU would take b, c, d, a too: see below
    for k in "xyz":
        p.push(k)
    p.pull("z")
    p.push("z")
    p.push("w")  # more recent than z, but never reused
    assert p.pop() == "x" and p.pop() == "y" and p.pop() == "w" and p.pop() == "z"


def test_s3fifo_moves_a_used_key_to_main_and_readmits_from_its_ghost() -> None:
    p: EvictionPolicy[str] = make_policy("s3fifo")
    p.push("a")
    p.push("b")
    p.pull("a")  # used while in small: moves to main when small is next looked at
    p.push("a")
    assert p.pop() == "b"
    p.push("c")
    p.push("d")
    assert p.peek(3) == ["c", "d", "a"]  # a sits in main now, behind small's unused keys
    q: EvictionPolicy[str] = make_policy("s3fifo")
    q.push("x")
    assert q.pop() == "x"  # remembered by the ghost
    q.push("x")  # back straight into main
    q.push("y")  # new: small, looked at first
    assert q.pop() == "y" and q.pop() == "x"
    lru: EvictionPolicy[str] = make_policy("lru")
    lru.push("x")
    lru.push("y")
    assert lru.pop() == "x"  # what S3-FIFO did differently


def test_s3fifo_ghost_remembers_a_slots_content_not_the_slot() -> None:
    """Slots (block ids) change content: the ghost readmits the same content in another slot,
    and not another content in the same slot."""
    p: EvictionPolicy[int] = make_policy("s3fifo")
    p.push(1, content="h")
    assert p.pop() == 1  # "h" is remembered
    p.push(7, content="x")  # new content in a new slot: small
    p.push(2, content="h")  # "h" again, in slot 2: straight into main
    p.push(1, content="y")  # slot 1 again, other content: small, like any new one
    assert p.peek(3) == [7, 1, 2]


@pytest.mark.parametrize("name", ["slru", "s3fifo"])
def test_a_one_time_scan_does_not_flush_the_hot_set(name: str) -> None:
    store = Store(name, capacity=10)
    for i in range(10):  # a full store, as a pool whose blocks have all been used once
        store.request([f"cold{i}"])
    hot = [f"hot{i}" for i in range(4)]
    for _ in range(3):
        for key in hot:
            store.request([key])
    for i in range(40):  # each key once, four times the store
        store.request([f"scan{i}"])
    assert sum(store.request([key]) for key in hot) == len(hot)


def test_the_same_scan_flushes_lru() -> None:
    """The scan above is one LRU does not survive: the scan test can fail."""
    store = Store("lru", capacity=10)
    for i in range(10):  # a full store, as a pool whose blocks have all been used once
        store.request([f"cold{i}"])
    hot = [f"hot{i}" for i in range(4)]
    for _ in range(3):
        for key in hot:
            store.request([key])
    for i in range(40):
        store.request([f"scan{i}"])
    assert sum(store.request([key]) for key in hot) == 0


def test_leaf_first_keeps_a_shared_prefix_past_its_tails() -> None:
    """The system block was pushed first (least recent), yet the tails go before it."""
    p: EvictionPolicy[str] = make_policy("leaf_lru")
    p.push("sys")
    p.push("a1", parent="sys")
    p.push("a2", parent="a1")
    p.push("b1", parent="sys")
    assert _pop_all(p) == ["a2", "a1", "b1", "sys"]
    lru: EvictionPolicy[str] = make_policy("lru")
    for k in ("sys", "a1", "a2", "b1"):
        lru.push(k)
    assert lru.pop() == "sys"  # LRU would drop the prefix both tails need


def test_leaf_first_falls_back_to_a_parent_when_no_leaf_is_evictable() -> None:
    p: EvictionPolicy[str] = make_policy("leaf_lru")
    p.push("head")
    p.push("tail", parent="head")
    p.pull("tail")  # in use: not evictable, still the head's child
    assert p.pop() == "head"
    p.push("tail")
    assert p.pop() == "tail" and len(p) == 0


def test_leaf_first_store_never_holds_a_block_without_its_prefix() -> None:
    rng = random.Random(3)
    store = Store("leaf_lru", capacity=12)
    for _ in range(400):
        conv = rng.randrange(6)
        keys = ["sys", *(f"c{conv}.{i}" for i in range(rng.randint(1, 6)))]
        store.request(keys)
        for key in store.held - {"sys"}:
            conv_id, depth = key[1:].split(".")
            parent = "sys" if depth == "0" else f"c{conv_id}.{int(depth) - 1}"
            assert parent in store.held, f"{key} outlived {parent}"


def test_fanout_protects_a_prefix_once_it_leads_into_a_third_chain() -> None:
    p: EvictionPolicy[str] = make_policy("fanout_lru")
    p.push("p", parent="r")
    p.push("r")
    for follower in ("x", "y"):  # the follower changes once: not yet shared
        p.pull("p")
        p.pull("r")
        p.push(follower, parent="p")
        p.push("p", parent="r")
        p.push("r")
    assert list(p) == ["x", "y", "p", "r"]  # LRU order
    p.pull("p")
    p.pull("r")
    p.push("z", parent="p")  # a second change: p and its ancestor r are shared
    p.push("p", parent="r")
    p.push("r")
    for key in ("q0", "q1", "q2", "q3"):
        p.push(key)
    # LRU would take p and r right after z; here they wait until they are more than half of
    # what is left (two of three), then take turns with the last own key.
    order = ["x", "y", "z", "q0", "q1", "q2", "p", "q3", "r"]
    assert list(p) == order
    assert _pop_all(p) == order


def test_fanout_gives_up_shared_keys_beyond_their_share() -> None:
    p: EvictionPolicy[str] = make_policy("fanout_lru")
    p.push("p")
    for follower in ("x", "y", "z"):
        p.pull("p")
        p.push(follower, parent="p")
        p.push("p")
    for key in ("x", "y", "z"):  # no longer evictable: p, shared, is half of what is
        p.pull(key)
    p.push("q")
    assert list(p) == ["q", "p"]
    p.pull("q")  # p alone: more than its share, so the next victim
    assert list(p) == ["p"] and p.pop() == "p"


def test_fanout_never_walks_into_a_slot_handed_to_another_block() -> None:
    """Slots as keys, as in the device pool: slot 1 held b's parent, then another block."""
    p: EvictionPolicy[int] = make_policy("fanout_lru")
    p.push(1, content="a")
    p.push(2, parent=1, content="b")
    p.pull(2)
    assert p.pop() == 1  # evicted: its link to slot 2 goes with it
    p.push(1, content="x")
    for slot, content in zip((10, 11, 12), "cde", strict=True):
        p.push(slot, parent=2, content=content)  # b leads into three chains: shared
    p.push(2, content="b")
    assert list(p) == [1, 10, 11, 12, 2]  # with slot 1 taken for b's parent: 10, 11, 1, ...
    p.check_integrity()


def test_fanout_iterates_in_the_order_it_evicts() -> None:
    """`__iter__` replays `pop`'s choice between the segments: a copy popped empty agrees, with
    shared keys above and below their share."""
    rng = random.Random(7)
    store = Store("fanout_lru", capacity=30)
    orders = []
    for step in range(300):  # four prompts of three blocks, to fill more than half the store
        k = rng.randrange(4)
        prefix = [f"sys{k}.{d}" for d in range(3)] if rng.random() < 0.8 else []
        store.request([*prefix, *(f"c{step}.{d}" for d in range(rng.randint(1, 8)))])
        if step % 10 == 0:
            orders.append(list(store.policy))
            assert orders[-1] == _pop_all(deepcopy(store.policy))
    # A prompt's block (shared: forked) before a conversation's: shared keys over their share.
    assert any(_a_prompt_before_a_conversation(order) for order in orders)


def _a_prompt_before_a_conversation(order: list[str]) -> bool:
    first_prompt = next((i for i, key in enumerate(order) if key.startswith("sys")), len(order))
    return any(key.startswith("c") for key in order[first_prompt:])


@pytest.mark.parametrize(("name", "expected_hits"), [("fanout_lru", 2), ("lru", 0)])
def test_fanout_keeps_a_system_prompt_that_lru_lets_one_off_chains_flush(
    name: str, expected_hits: int
) -> None:
    store = Store(name, capacity=12)
    for i in range(4):  # four conversations in a row: the prompt's follower changes thrice
        store.request(["s0", "s1", f"warm{i}"])
    hits = []
    for i in range(10):
        hits.append(store.request(["s0", "s1", f"conv{i}"]))
        for j in range(2):  # two chains of their own, 12 blocks: more than LRU keeps
            store.request([f"once{i}.{j}.{d}" for d in range(6)])
    assert hits[1:] == [expected_hits] * 9


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_random_operations_keep_the_contract(name: str) -> None:
    """Against a set of evictable keys: membership and size agree, `pop` returns a member,
    `peek`'s first key is the next victim, and `to_front` makes it so."""
    rng = random.Random(name)
    p: EvictionPolicy[int] = make_policy(name)
    evictable: set[int] = set()
    known: set[int] = set()  # pushed and not yet popped or discarded
    for _ in range(3000):
        op = rng.random()
        key = rng.randrange(60)
        if op < 0.4:
            parent = rng.choice([None, *known]) if known else None
            p.push(key, None if parent == key else parent)
            evictable.add(key)
            known.add(key)
        elif op < 0.6:
            p.pull(key)
            evictable.discard(key)
        elif op < 0.65:
            p.discard(key)
            evictable.discard(key)
            known.discard(key)
        elif op < 0.7 and key in evictable:
            p.to_front(key)
            if name != "leaf_lru":  # which still takes the key's descendants first
                assert p.peek(1) == [key]
        elif evictable:
            [first] = p.peek(1)
            victim = p.pop()
            assert victim == first and victim in evictable
            evictable.discard(victim)
            known.discard(victim)
        assert len(p) == len(evictable)
        assert all((k in p) == (k in evictable) for k in range(60))
        p.check_integrity()
    assert set(p) == evictable
    assert sorted(_pop_all(p)) == sorted(evictable)  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        p.pop()


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="lru, slru, s3fifo, leaf_lru, fanout_lru"):
        make_policy("arc")
