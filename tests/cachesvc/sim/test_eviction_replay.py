"""`cachesvc simulate eviction`: the replay, Belady's optimum as its limit, the verdict and the
command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cachesvc.app.cli.main import main
from cachesvc.kv.block_pool import BlockPool
from cachesvc.kv.eviction.base import POLICY_NAMES, make_policy
from cachesvc.kv.types import BlockId
from cachesvc.sim.belady import Belady, ReuseOracle
from cachesvc.sim.eviction import ReplayResult, replay, run_eviction, workload_requests
from cachesvc.sim.eviction_report import bounds, choose_default, verdicts
from cachesvc.sim.trace import SimRequest, block_hash, load_trace, oracle_hit_blocks


def _random_requests(seed: int, num: int = 300) -> list[SimRequest]:
    """Chains in a random prefix tree: a few roots, conversations that grow, some one-offs."""
    rng = random.Random(seed)
    next_id = 0
    contexts: list[list[int]] = [[] for _ in range(12)]
    roots = [[next_id + i] for i in range(3)]
    next_id += 3
    out = []
    for i in range(num):
        c = rng.randrange(len(contexts))
        if not contexts[c] or rng.random() < 0.2:  # a new conversation
            contexts[c] = list(rng.choice(roots))
        grow = rng.randint(1, 4)
        contexts[c].extend(range(next_id, next_id + grow))
        next_id += grow
        ids = contexts[c]
        prompt_len = len(ids) * 4  # blocks of 4: the last block is never matched
        out.append(SimRequest(i, float(i), prompt_len, 1, tuple(map(block_hash, ids)), 4))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [8, 20, 60])
def test_belady_hits_at_least_every_policy(seed: int, capacity: int) -> None:
    requests = _random_requests(seed)
    best = replay(requests, Belady(requests), capacity)
    for name in POLICY_NAMES:
        assert replay(requests, make_policy(name), capacity) <= best, name
    assert replay(requests, ReuseOracle(requests), capacity) <= best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("capacity", [8, 20, 60])
def test_knowing_which_blocks_come_back_hits_at_least_lru(seed: int, capacity: int) -> None:
    requests = _random_requests(seed)
    lru = replay(requests, make_policy("lru"), capacity)
    assert replay(requests, ReuseOracle(requests), capacity) >= lru


def _pool_hits(requests: list[SimRequest], policy: str, capacity: int) -> int:
    """The replay's requests served by a real `BlockPool`: a block held is touched, a missing
    one allocated and registered under its parent, all freed tail first."""
    pool = BlockPool(capacity, policy=policy)
    hits = 0
    for r in requests:
        blocks = r.hashes[: r.num_full_blocks]
        n = 0
        while n < r.max_match_blocks and pool.lookup(r.hashes[n], ()) is not None:
            n += 1
        hits += n
        used: list[BlockId] = []
        for i, h in enumerate(blocks):
            found = pool.lookup(h, ())
            if found is not None:
                pool.touch([found])
            elif pool.num_free:
                [found] = pool.allocate(1)
                pool.register(found, h, (), blocks[i - 1] if i else None)
            else:
                continue
            used.append(found)
        pool.free(list(reversed(used)))
    pool.check_integrity()
    return hits


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("capacity", [8, 30])
def test_the_replay_hits_as_the_block_pool_does(name: str, capacity: int) -> None:
    """The replay is the device pool's behaviour under each policy, block for block."""
    requests = _random_requests(5)
    assert replay(requests, make_policy(name), capacity) == _pool_hits(requests, name, capacity)


def test_a_store_holding_everything_hits_as_the_oracle(sample_trace: Path) -> None:
    requests = load_trace(sample_trace)
    everything = len({h for r in requests for h in r.hashes})
    for name in (*POLICY_NAMES, "belady"):
        policy = Belady(requests) if name == "belady" else make_policy(name)
        assert replay(requests, policy, everything) == sum(oracle_hit_blocks(requests)), name


def test_run_eviction_reports_every_policy_and_belady(sample_trace: Path) -> None:
    requests = load_trace(sample_trace)
    results = run_eviction({"trace": requests}, [1, 5], ["lru", "s3fifo"])
    assert [(r.size_pct, r.policy) for r in results] == [
        (100, "unbounded"),
        (1, "lru"),
        (1, "s3fifo"),
        (1, "reuse_oracle"),
        (1, "belady"),
        (5, "lru"),
        (5, "s3fifo"),
        (5, "reuse_oracle"),
        (5, "belady"),
    ]
    for r in results:
        assert 0 <= r.hit_ratio <= 1 and r.capacity_blocks >= 1
    unbounded, small, large = results[0], results[4], results[8]
    assert unbounded.hit_blocks == sum(oracle_hit_blocks(requests))
    assert unbounded.hit_ratio >= large.hit_ratio >= small.hit_ratio  # Belady's, by size


def _results(cells: dict[tuple[str, int], dict[str, int]]) -> list[ReplayResult]:
    return [
        ReplayResult(w, p, s, 10, hits, 100)
        for (w, s), row in cells.items()
        for p, hits in row.items()
    ]


def test_the_default_stays_lru_unless_a_policy_meets_the_goal() -> None:
    cells = {
        ("trace", 1): {"lru": 10, "a": 11, "b": 12, "belady": 40},
        ("multi-turn", 1): {"lru": 10, "a": 20, "b": 30, "belady": 40},
        ("multi-turn", 5): {"lru": 20, "a": 19, "b": 40, "belady": 50},
    }
    assert choose_default(_results(cells)) == "b"
    [a, b] = verdicts(_results(cells))
    assert not a.meets_goal and a.worst_at == "multi-turn 5%"
    assert b.meets_goal and b.gap_closed == pytest.approx({1: 2 / 3, 5: 2 / 3})
    cells[("multi-turn", 5)]["b"] = 25  # closes a sixth of the gap there: nobody meets it
    assert choose_default(_results(cells)) == "lru"
    for cell in cells.values():  # an oracle meeting the goal is a bound, never the default
        cell["reuse_oracle"] = cell["belady"]
    assert [v.policy for v in verdicts(_results(cells))] == ["a", "b"]
    [bound] = bounds(_results(cells))
    assert bound.policy == "reuse_oracle" and bound.meets_goal
    assert choose_default(_results(cells)) == "lru"


def test_generated_workloads_are_conversations_and_mixed() -> None:
    multi = workload_requests("multi-turn", None, 200)
    mixed = workload_requests("mixed", None, 200)
    assert len(multi) == len(mixed) == 200
    with pytest.raises(ValueError, match="--trace"):
        workload_requests("trace", None, None)


def test_command_prints_the_table_and_writes_json(
    sample_trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ev.json"
    argv = ["simulate", "eviction", "--trace", str(sample_trace), "--sizes", "2"]
    argv += ["--workloads", "trace,multi-turn", "--max-requests", "150", "--json", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| workload" in text and "belady" in text and "default: " in text
    payload = json.loads(out.read_text())
    assert {r["workload"] for r in payload["results"]} == {"trace", "multi-turn"}
    assert payload["default"] in POLICY_NAMES


@pytest.mark.parametrize(
    ("flags", "field"),
    [(["--policies", "arc"], "--policies"), (["--sizes", "0"], "--sizes")],
)
def test_bad_flags_are_named(
    flags: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "eviction", "--workloads", "multi-turn", *flags]) == 2
    assert field in capsys.readouterr().err


def test_belady_puts_a_block_sent_to_the_front_out_first() -> None:
    from cachesvc.kv.types import BlockHash
    from cachesvc.sim.belady import Belady

    policy = Belady([])
    first, second = BlockHash(b"a" * 16), BlockHash(b"b" * 16)
    policy.push(first)
    policy.push(second)
    policy.to_front(first)
    assert [policy.pop(), policy.pop()] == [first, second]
