"""Block hashing: golden vectors, chaining, salts, purge epochs, and determinism across
processes."""

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachesvc.kv.hashing import PURGE_SALT_PREFIX, block_hash, epoch_salt, hash_blocks, root_hash

# Pinned: changing the hash format silently would orphan every stored block and route wrongly.
GOLDEN_ROOT = "5d82031219ae99267e10e0696d19c1ee"
GOLDEN_BLOCKS = ["e13e449588ef3f432ee90cb849e24f0f", "343d1a3803b24154112099d7ac09ac74"]


def test_golden_vectors() -> None:
    root = root_hash("abc", 16)
    assert root.hex() == GOLDEN_ROOT
    assert [h.hex() for h in hash_blocks(list(range(40)), 16, root)] == GOLDEN_BLOCKS


def test_only_full_blocks_are_hashed() -> None:
    root = root_hash("m", 4)
    assert len(hash_blocks(list(range(11)), 4, root)) == 2
    assert hash_blocks([1, 2, 3], 4, root) == []


def test_root_separates_model_block_size_and_salt() -> None:
    roots = {
        root_hash("m1", 16),
        root_hash("m2", 16),
        root_hash("m1", 32),
        root_hash("m1", 16, "tenant-a"),
        root_hash("m1", 16, "tenant-b"),
    }
    assert len(roots) == 5


def test_epoch_zero_keeps_the_salt_and_the_golden_vectors() -> None:
    # A service never purged must keep every hash it stored before epochs existed.
    for salt in (None, "", "s", "tenant:acme/x"):
        assert epoch_salt(salt, 0) == salt
    root = root_hash("abc", 16, epoch_salt(None, 0) or "")
    assert root.hex() == GOLDEN_ROOT
    assert [h.hex() for h in hash_blocks(list(range(40)), 16, root)] == GOLDEN_BLOCKS


@pytest.mark.parametrize(
    ("salt", "epoch", "expected"),
    [
        (None, 1, "purge:1/"),
        ("", 1, "purge:1/"),
        ("s", 2, "purge:2/s"),
        ("tenant:acme/x", 12, "purge:12/tenant:acme/x"),
    ],
)
def test_epoch_salt(salt: str | None, epoch: int, expected: str) -> None:
    assert epoch_salt(salt, epoch) == expected


def test_every_epoch_gives_new_hashes() -> None:
    tokens = list(range(40))
    roots = [root_hash("m", 4, epoch_salt("tenant:a", e) or "") for e in range(4)]
    chains = [hash_blocks(tokens, 4, root) for root in roots]
    # Not one block of one epoch is a block of another: a lookup under a new epoch finds none.
    assert len({h for chain in chains for h in chain}) == 4 * len(chains[0])


# Salts a client may send: anything but the reserved prefix (the router refuses it).
_client_salts = st.one_of(st.none(), st.text(max_size=12)).filter(
    lambda s: s is None or not s.startswith(PURGE_SALT_PREFIX)
)


@given(_client_salts, st.integers(0, 50), _client_salts, st.integers(0, 50))
def test_no_two_salt_epoch_pairs_meet(a: str | None, ea: int, b: str | None, eb: int) -> None:
    # None and "" are one salt to the workers (both hash as "").
    if (a or "", ea) != (b or "", eb):
        assert (epoch_salt(a, ea) or "") != (epoch_salt(b, eb) or "")


def test_negative_epoch_is_refused() -> None:
    with pytest.raises(ValueError):
        epoch_salt("s", -1)


def test_hash_names_the_whole_prefix() -> None:
    root = root_hash("m", 2)
    a = hash_blocks([1, 2, 3, 4], 2, root)
    b = hash_blocks([9, 9, 3, 4], 2, root)
    assert a[1] != b[1]  # same last block, different prefix


@given(st.lists(st.integers(0, 2**32 - 1), max_size=64), st.integers(1, 8))
def test_incremental_equals_one_shot(tokens: list[int], block_size: int) -> None:
    root = root_hash("m", block_size)
    full = hash_blocks(tokens, block_size, root)
    k = len(full) // 2
    head = full[:k]
    rest = hash_blocks(tokens, block_size, root, start_block=k, parent=head[-1] if k else None)
    assert head + rest == full


def test_rejects_ids_outside_uint32() -> None:
    with pytest.raises(ValueError):
        block_hash(root_hash("m", 1), [2**32])
    with pytest.raises(ValueError):
        block_hash(root_hash("m", 1), [-1])


def test_same_hash_in_another_process_with_another_hash_seed() -> None:
    code = (
        "from cachesvc.kv.hashing import hash_blocks, root_hash;"
        "print(hash_blocks(list(range(40)), 16, root_hash('abc', 16))[-1].hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == GOLDEN_BLOCKS[-1]
