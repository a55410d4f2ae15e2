"""Block hashing: golden vectors, chaining, salts, and determinism across processes."""

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachesvc.hashing import block_hash, hash_blocks, root_hash

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
        "from cachesvc.hashing import hash_blocks, root_hash;"
        "print(hash_blocks(list(range(40)), 16, root_hash('abc', 16))[-1].hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == GOLDEN_BLOCKS[-1]
