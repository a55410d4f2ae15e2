"""MemoryPrefixIndex: events in order, gap detection, resync, dead workers, and longest prefix
against a plain dict model under random event streams."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared, Event
from cachesvc.kv.hashing import hash_blocks, root_hash
from cachesvc.kv.index import TIER_ORDER, IndexSnapshot, MemoryPrefixIndex, PrefixMatch
from cachesvc.kv.types import BlockHash, WorkerId

A, B = WorkerId("a"), WorkerId("b")
ROOT = root_hash("fp", 4)
H = hash_blocks(list(range(40)), 4, ROOT)  # ten chained hashes


def _index(*workers: WorkerId) -> MemoryPrefixIndex:
    index = MemoryPrefixIndex()
    for w in workers:
        index.resync(w, IndexSnapshot("inc", 0, {}))
    return index


def _stored(seq: int, hashes: list[BlockHash], tier: str = "hbm") -> BlockStored:
    return BlockStored(seq, tier, tuple(hashes))


def test_longest_prefix_per_worker() -> None:
    index = _index(A, B)
    assert index.apply(A, "inc", [_stored(0, H[:5])])
    assert index.apply(B, "inc", [_stored(0, H[:2]), _stored(1, H[3:6])])  # B lacks H[2]
    assert index.longest_prefix(H) == {
        A: PrefixMatch(A, 5, {"hbm": 5}),
        B: PrefixMatch(B, 2, {"hbm": 2}),
    }
    assert index.longest_prefix(H[1:]) == {A: PrefixMatch(A, 4, {"hbm": 4})} | {
        B: PrefixMatch(B, 1, {"hbm": 1})
    }
    assert index.longest_prefix([]) == {}
    index.check_integrity()


def test_tiers_moves_and_removal() -> None:
    index = _index(A)
    events: list[Event] = [
        _stored(0, H[:4]),
        BlockMoved(1, tuple(H[2:4]), "hbm", "dram"),
        _stored(2, H[3:4], "hbm"),  # H[3] is now in both tiers: counts in the fastest
        BlockRemoved(3, "hbm", tuple(H[1:2])),
    ]
    assert index.apply(A, "inc", events)
    assert index.longest_prefix(H) == {A: PrefixMatch(A, 1, {"hbm": 1})}
    assert index.apply(A, "inc", [_stored(4, H[1:2], "nvme")])
    assert index.longest_prefix(H) == {A: PrefixMatch(A, 4, {"hbm": 2, "nvme": 1, "dram": 1})}
    assert index.apply(A, "inc", [Cleared(5, "hbm")])
    assert index.longest_prefix(H) == {}  # H[0] was only in hbm
    assert index.num_blocks(A) == 3
    index.check_integrity()


def test_gap_and_stale_incarnation_ask_for_resync() -> None:
    index = _index(A)
    assert index.apply(A, "inc", [_stored(0, H[:1])])
    assert index.apply(A, "inc", [_stored(0, H[:1])])  # a repeat is skipped
    assert not index.apply(A, "inc", [_stored(2, H[1:2])])  # seq 1 is missing
    assert index.next_seq(A) == 1
    assert not index.apply(A, "restarted", [_stored(1, H[1:2])])
    assert not index.apply(B, "inc", [])  # never synced
    index.resync(A, IndexSnapshot("restarted", 7, {"hbm": H[:3]}))
    assert index.next_seq(A) == 7
    assert index.apply(A, "restarted", [_stored(6, H[5:6]), _stored(7, H[3:4])])
    assert index.longest_prefix(H)[A].num_blocks == 4
    index.check_integrity()


def test_drop_worker_forgets_it() -> None:
    index = _index(A, B)
    index.apply(A, "inc", [_stored(0, H[:3])])
    index.apply(B, "inc", [_stored(0, H[:3])])
    index.drop_worker(A)
    index.drop_worker(WorkerId("unknown"))
    assert set(index.longest_prefix(H)) == {B}
    assert index.next_seq(A) is None and index.num_blocks(A) == 0
    index.check_integrity()


# ---- random streams against a dict model --------------------------------------------------------

TIERS = ("hbm", "dram", "nvme")
_event = st.tuples(
    st.sampled_from(["store", "remove", "move", "clear"]),
    st.sampled_from(TIERS),
    st.sampled_from(TIERS),
    st.lists(st.integers(0, 9), min_size=1, max_size=4),
)


def _model_prefix(model: dict[BlockHash, set[str]], hashes: list[BlockHash]) -> int:
    n = 0
    while n < len(hashes) and model.get(hashes[n]):
        n += 1
    return n


@settings(max_examples=150, deadline=None)
@given(st.lists(_event, max_size=30))
def test_random_streams_match_dict_model(ops: list[tuple[str, str, str, list[int]]]) -> None:
    index = _index(A)
    model: dict[BlockHash, set[str]] = {}
    for seq, (kind, tier, dst, picks) in enumerate(ops):
        hashes = tuple(H[i] for i in picks)
        event: Event
        if kind == "store":
            event = BlockStored(seq, tier, hashes)
            for h in hashes:
                model.setdefault(h, set()).add(tier)
        elif kind == "remove":
            event = BlockRemoved(seq, tier, hashes)
            for h in hashes:
                model.get(h, set()).discard(tier)
        elif kind == "move":
            event = BlockMoved(seq, hashes, tier, dst)
            for h in hashes:  # the worker says where the block is now, whatever we knew
                model.setdefault(h, set()).discard(tier)
                model[h].add(dst)
        else:
            event = Cleared(seq, tier)
            for tiers in model.values():
                tiers.discard(tier)
        assert index.apply(A, "inc", [event])
        index.check_integrity()
    match = index.longest_prefix(H).get(A)
    assert (0 if match is None else match.num_blocks) == _model_prefix(model, H)
    assert index.num_blocks(A) == sum(1 for tiers in model.values() if tiers)


@given(
    st.dictionaries(
        st.sampled_from(["w0", "w1", "w2"]),
        st.lists(st.sets(st.sampled_from(["hbm", "dram", "nvme", "redis"])), max_size=8),
        max_size=3,
    )
)
def test_longest_prefix_equals_a_walk_block_by_block(holdings: dict[str, list[set[str]]]) -> None:
    """Per worker, the leading run of blocks it holds, each counted in its fastest tier."""
    index = MemoryPrefixIndex()
    for worker, per_block in holdings.items():
        blocks: dict[str, list[BlockHash]] = {}
        for block_hash, tiers in zip(H, per_block, strict=False):
            for tier in tiers:
                blocks.setdefault(tier, []).append(block_hash)
        index.resync(WorkerId(worker), IndexSnapshot("i", 0, blocks))
    index.check_integrity()
    expected = {}
    for worker, per_block in holdings.items():
        counts: dict[str, int] = {}
        for tiers in per_block:
            if not tiers:
                break
            fastest = min(tiers, key=TIER_ORDER.index)
            counts[fastest] = counts.get(fastest, 0) + 1
        if counts:
            expected[WorkerId(worker)] = PrefixMatch(WorkerId(worker), sum(counts.values()), counts)
    assert index.longest_prefix(H) == expected
