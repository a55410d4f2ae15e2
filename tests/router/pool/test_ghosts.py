"""The record of recently removed blocks: bounded, laid to rest when stored again."""

from __future__ import annotations

from cachesvc.kv.events import BlockMoved, BlockRemoved, BlockStored, Cleared
from cachesvc.kv.types import BlockHash
from router.pool.ghosts import GhostRecord


def _h(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def test_removed_then_stored_again() -> None:
    ghosts = GhostRecord()
    ghosts.observe([BlockRemoved(0, "hbm", (_h(1), _h(2)))])
    assert ghosts.get(_h(1)) is not None and ghosts.get(_h(2)) is not None
    ghosts.observe([BlockStored(1, "hbm", (_h(1),)), BlockMoved(2, (_h(2),), "nvme", "dram")])
    assert ghosts.get(_h(1)) is None and ghosts.get(_h(2)) is None
    # In one batch, the order of the events decides.
    ghosts.observe([BlockStored(3, "hbm", (_h(3),)), BlockRemoved(4, "hbm", (_h(3),))])
    assert ghosts.get(_h(3)) is not None
    ghosts.observe([Cleared(5, "hbm")])  # names no hash: changes nothing
    assert len(ghosts) == 1


def test_bounded_forgetting_the_least_recent() -> None:
    ghosts = GhostRecord(max_entries=3)
    for i in range(5):
        ghosts.observe([BlockRemoved(i, "hbm", (_h(i),))])
        ghosts.check_integrity()
    assert len(ghosts) == 3
    assert [ghosts.get(_h(i)) is not None for i in range(5)] == [False, False, True, True, True]
    # A removal again makes a ghost the newest: the next one past the bound forgets another.
    ghosts.observe([BlockRemoved(5, "dram", (_h(2),))])
    ghosts.observe([BlockRemoved(6, "hbm", (_h(9),))])
    assert ghosts.get(_h(2)) is not None and ghosts.get(_h(3)) is None


def test_expired_only_when_its_retention_ran_out_before_removal() -> None:
    clock = [100.0]
    ghosts = GhostRecord(max_entries=3, clock=lambda: clock[0])
    ghosts.retained([_h(1), _h(2)], 10.0)
    ghosts.retained([_h(1)], 5.0)  # a shorter retention does not shorten a longer one
    clock[0] = 108.0
    ghosts.observe([BlockRemoved(0, "hbm", (_h(1),))])
    clock[0] = 110.0
    ghosts.observe([BlockRemoved(1, "hbm", (_h(2), _h(3)))])
    g1, g2, g3 = (ghosts.get(_h(i)) for i in (1, 2, 3))
    assert g1 is not None and not g1.expired
    assert g2 is not None and g2.expired
    assert g3 is not None and not g3.expired  # never retained
    # The retentions are bounded too: past three, the least recently asked is forgotten (h2's:
    # h1's was asked again since).
    ghosts.retained([_h(4), _h(5)], 1.0)
    ghosts.check_integrity()
    clock[0] = 200.0
    ghosts.observe([BlockRemoved(2, "hbm", (_h(1), _h(2), _h(4)))])
    g1, g2, g4 = (ghosts.get(_h(i)) for i in (1, 2, 4))
    assert g1 is not None and g1.expired
    assert g2 is not None and not g2.expired
    assert g4 is not None and g4.expired
