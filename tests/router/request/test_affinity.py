"""Affinity keys: a key's requests go to the worker its last one went to while that worker is
within `prefix_aware`'s bounds (the load bound and the traffic bound prefix routing uses), and
the table of keys is per tenant and bounded."""

from __future__ import annotations

import dataclasses

import pytest

from cachesvc.kv.index import PrefixMatch
from cachesvc.kv.types import WorkerId
from router.policy.routing import Candidate, PrefixAware, RouteRequest, choose_and_record
from router.request.affinity import AffinityTable, scoped_key

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
REQ = RouteRequest(num_prompt_tokens=64, block_size=16)


def _c(worker: WorkerId, requests: int = 0, queued: int = 0, blocks: int = 0) -> Candidate:
    match = PrefixMatch(worker, blocks, {"hbm": blocks}) if blocks else None
    return Candidate(worker, requests, queued, match)


@pytest.mark.parametrize(
    ("candidates", "affinity", "expected"),
    [
        ([_c(W0, blocks=3), _c(W1)], None, W0),  # no key: the holder
        ([_c(W0, blocks=3), _c(W1)], W1, W1),  # the key's worker, though it holds nothing
        ([_c(W0), _c(W1, requests=3, queued=40)], W1, W1),  # busier, still within bounds
        ([_c(W0, blocks=3), _c(W1, requests=40, queued=10**7)], W1, W0),  # saturated: left
        ([_c(W0, blocks=3), _c(W1)], W2, W0),  # its worker is gone: routed as any request
    ],
)
def test_a_keys_worker_wins_within_bounds(
    candidates: list[Candidate], affinity: WorkerId | None, expected: WorkerId
) -> None:
    request = dataclasses.replace(REQ, affinity=affinity)
    assert PrefixAware().choose(request, candidates).worker == expected


def test_a_hot_key_spills_past_the_traffic_bound() -> None:
    policy = PrefixAware()
    candidates = [_c(W0), _c(W1), _c(W2)]
    table = AffinityTable()
    picks = []
    for i in range(30):
        request = RouteRequest(64, 16, now_s=float(i), affinity=table.worker("k"))
        picks.append(choose_and_record(policy, request, candidates).worker)
        table.routed("k", picks[-1])
    first = picks[0]
    assert picks[:4] == [first] * 4  # sticky while the others get little
    assert set(picks) != {first}  # and the bound spills a hot key, as it spills a hot prefix
    assert picks.count(first) > len(picks) / 3


def test_the_table_is_per_tenant_and_bounded() -> None:
    assert scoped_key("tenant:a", "k") != scoped_key("tenant:b", "k")
    assert scoped_key(None, None) is None
    table = AffinityTable(max_keys=2)
    for key, worker in (("a", W0), ("b", W1), ("a", W2), ("c", W0)):
        table.routed(key, worker)
    assert len(table) == 2
    assert (table.worker("a"), table.worker("b"), table.worker("c")) == (W2, None, W0)
    assert table.worker(None) is None
