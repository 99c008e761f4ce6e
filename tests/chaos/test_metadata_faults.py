"""Faults of the metadata service and of etcd under load, on a live cluster whose metadata service
keeps its index in etcd (tests/chaos/conftest.py): stalled past twice the lease TTL, killed and
restarted, and etcd killed and restarted. Goals: the whole load sent and every request of it
completed (some while the fault lasted), no request lost, nothing leaked, routing stays
prefix-aware from the router's mirror during a stall, no live node's blocks erased from the
index, and the index exact within a lease TTL after."""

from __future__ import annotations

import pytest

from tests.chaos.conftest import assert_load_sent_and_completed, start_chaos

pytestmark = pytest.mark.timeout(600)
LEASE_TTL_S = 3


@pytest.fixture(scope="module")
def chaos(model_dirs):
    running = start_chaos(model_dirs, lease_ttl_s=LEASE_TTL_S, backend="etcd")
    yield running
    running.cluster.stop()


def assert_nothing_lost_or_leaked(result: dict, name: str) -> None:
    assert_load_sent_and_completed(result, name, LEASE_TTL_S)
    assert result["failed"] == 0 and result["truncated"] == 0, result["failed_by_cause"]
    assert result["leaked_blocks"] == 0, result["leaks_per_node"]
    assert result["index_exact_within_ttl"], result.get("index_problems")


def test_a_stalled_metadata_service_erases_nothing(chaos):
    result = chaos.fault("metadata_stall")
    assert result["stall_s"] == 2 * LEASE_TTL_S
    assert_nothing_lost_or_leaked(result, "metadata_stall")
    assert result["nodes_erased_from_router_index"] == []
    assert result["prefix_aware_share_during"] == 1.0


def test_a_restarted_metadata_service_is_resynced(chaos):
    assert_nothing_lost_or_leaked(chaos.fault("metadata_restart"), "metadata_restart")


def test_a_restarted_etcd_loses_nothing(chaos):
    assert_nothing_lost_or_leaked(chaos.fault("etcd_restart"), "etcd_restart")
