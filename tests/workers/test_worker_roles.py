"""Worker roles for prefill/decode disaggregation: what a role may be, which worker of a group
has which, and the engine config each one runs (pure: no Ray here)."""

from __future__ import annotations

import pytest

from cachesvc.kv.config import ConfigError
from cachesvc.kv.types import WorkerId
from workers.cluster import (
    DECODE_PULL_TIMEOUT_S,
    WorkerGroup,
    placement_report,
    role_resource,
    worker_index,
    worker_resources,
)
from workers.config import EngineConfig
from workers.protocol import WorkerInfo

ENGINE = EngineConfig(model="tiny", device="cpu")


def test_role_defaults_to_mixed_and_a_bad_role_names_the_field() -> None:
    assert ENGINE.role == "mixed"
    assert EngineConfig(role="prefill").role == "prefill"
    with pytest.raises(ConfigError, match=r"role must be one of .*'mixed'.*got 'prefil'"):
        EngineConfig(role="prefil")


@pytest.mark.parametrize(
    ("num_workers", "num_prefill", "num_decode", "roles"),
    [
        (3, 0, 0, ["mixed", "mixed", "mixed"]),
        (2, 1, 1, ["prefill", "decode"]),
        (5, 2, 1, ["prefill", "prefill", "decode", "mixed", "mixed"]),
        (3, 0, 2, ["decode", "decode", "mixed"]),
        (2, 2, 0, ["prefill", "prefill"]),
    ],
)
def test_role_of_gives_prefill_then_decode_then_mixed(
    num_workers: int, num_prefill: int, num_decode: int, roles: list[str]
) -> None:
    group = WorkerGroup(ENGINE, num_workers, num_prefill=num_prefill, num_decode=num_decode)
    assert [group.role_of(i) for i in range(num_workers)] == roles
    with pytest.raises(IndexError):
        group.role_of(num_workers)


@pytest.mark.parametrize(
    ("num_workers", "num_prefill", "num_decode", "message"),
    [
        (2, 2, 1, r"num_prefill \+ num_decode \(2 \+ 1\) must not exceed num_workers \(2\)"),
        (1, 0, 2, "must not exceed num_workers"),
        (3, -1, 0, "must be >= 0"),
    ],
)
def test_more_role_workers_than_workers_is_refused(
    num_workers: int, num_prefill: int, num_decode: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerGroup(ENGINE, num_workers, num_prefill=num_prefill, num_decode=num_decode)


def test_each_worker_runs_its_roles_engine_with_peer_pulls_on_when_roles_are_used() -> None:
    group = WorkerGroup(ENGINE, 3, num_prefill=1, num_decode=1)
    engines = [group.engine_of(i, ENGINE) for i in range(3)]
    assert [e.role for e in engines] == ["prefill", "decode", "mixed"]
    # Decode workers pull what prefill workers computed: every worker of the group may pull.
    assert all(e.peer_pull for e in engines)
    # A decode worker waits for a prefill worker's step boundary rather than recompute.
    assert engines[1].peer_pull_timeout_s == DECODE_PULL_TIMEOUT_S
    assert engines[0].peer_pull_timeout_s == ENGINE.peer_pull_timeout_s
    # Everything else is the group's engine, unchanged.
    assert engines[1] == EngineConfig(
        model="tiny",
        device="cpu",
        role="decode",
        peer_pull=True,
        peer_pull_timeout_s=DECODE_PULL_TIMEOUT_S,
    )


def test_a_group_without_roles_keeps_its_engine_as_configured() -> None:
    group = WorkerGroup(ENGINE, 2)
    assert [group.engine_of(i, ENGINE) for i in range(2)] == [ENGINE, ENGINE]
    # An operator's explicit --peer-pull is kept.
    pulling = EngineConfig(model="tiny", peer_pull=True)
    assert group.engine_of(0, pulling).peer_pull


def test_worker_index_reads_the_id_spawn_workers_made() -> None:
    assert worker_index(WorkerId("worker-12")) == 12
    with pytest.raises(ValueError, match="worker-<index>"):
        worker_index(WorkerId("gpu-3"))


def _info(worker: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker, "inc", "fp", 4, 320, 512, "cpu", node_id="a" * 16, role=role)


def test_placement_report_says_each_workers_role_but_not_mixed() -> None:
    infos = {
        WorkerId("worker-0"): _info("worker-0", "prefill"),
        WorkerId("worker-1"): _info("worker-1", "decode"),
        WorkerId("worker-2"): _info("worker-2", "mixed"),
    }
    lines = placement_report(infos)
    assert lines[0].startswith("worker-0 (prefill) runs on node aaaaaaaaaaaa")
    assert lines[1].startswith("worker-1 (decode) runs on node")
    assert lines[2].startswith("worker-2 runs on node")


def test_workers_ask_for_their_roles_resource_where_nodes_offer_it() -> None:
    group = WorkerGroup(ENGINE, 3, num_prefill=1, num_decode=1)
    # Nodes started for prefill and decode (the Helm chart's role groups): each worker of
    # those roles asks for one unit, so it lands on a pod of its role; no mixed nodes here.
    cluster = {"CPU": 8.0, role_resource("prefill"): 2.0, role_resource("decode"): 1.0}
    asks = worker_resources(group, cluster)
    assert asks.resources_of("prefill") == {"cachesvc_role_prefill": 1.0}
    assert asks.resources_of("decode") == {"cachesvc_role_decode": 1.0}
    assert asks.resources_of("mixed") == {}
    # A cluster without such nodes (one machine, `cachesvc serve` alone): nobody asks.
    plain = worker_resources(group, {"CPU": 8.0})
    assert [plain.resources_of(r) for r in ("prefill", "decode", "mixed")] == [{}, {}, {}]
