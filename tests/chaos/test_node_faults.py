"""Faults of nodes and clients under load, on a live cluster (tests/chaos/conftest.py): each
fault of `python -m benchmarks chaos` at a small size, asserting its goals: no request
lost (a decode node's death may cost only the streams it had open), no KV block leaked on
any node once the load drained, and the global index exact again within a lease TTL."""

from __future__ import annotations

import pytest

from benchmarks.chaos_load import LoadSpec
from tests.chaos.conftest import assert_load_sent_and_completed, start_chaos

pytestmark = pytest.mark.timeout(600)
LEASE_TTL_S = 3


@pytest.fixture(scope="module")
def chaos(model_dirs):
    running = start_chaos(model_dirs, lease_ttl_s=LEASE_TTL_S)
    yield running
    running.cluster.stop()


def assert_nothing_lost_or_leaked(result: dict) -> None:
    assert result["failed"] == 0 and result["truncated"] == 0, result["failed_by_cause"]
    assert result["leaked_blocks"] == 0, result["leaks_per_node"]
    assert result["index_exact_within_ttl"], result.get("index_problems")


def test_a_prefill_node_killed_mid_transfer_is_recomputed_without_waiting(chaos):
    result = chaos.fault("prefill_kill")
    assert_load_sent_and_completed(result, "prefill_kill", LEASE_TTL_S)
    assert result["inflight_at_kill"] > 0  # the kill caught KV in flight to a decode node
    assert_nothing_lost_or_leaked(result)
    # the decode nodes were told (not one waited out its 30 s KV timeout)
    assert result["router"]["router_prefill_lost_total"] >= 1
    assert result["decode_transfers"]["sources_lost"] >= 1
    assert result["decode_transfers"]["timeouts"] == 0
    assert result["inflight_done_after_fault_s_max"] < 10


def test_a_decode_node_killed_with_open_streams_moves_them(chaos):
    result = chaos.fault("decode_kill")
    assert_load_sent_and_completed(result, "decode_kill", LEASE_TTL_S)
    assert result["inflight_at_kill"] > 0
    assert_nothing_lost_or_leaked(result)  # each open stream moved to the other decode node
    assert result["router"]["router_migrations_total"] >= 1


def test_an_abort_storm_leaves_every_node_idle_within_a_second(chaos):
    # 48 tokens out: long enough that most aborts (5-250 ms after sending) land before the
    # request ends, on a quiet machine too (8 tokens: 16 of 90 landed there)
    storm = LoadSpec(rate=40.0, count=120, max_tokens=48, abort_after_s=(0.005, 0.25),
                     abort_share=0.75, seed=3)
    result = chaos.abort_storm(storm)
    assert result["aborted_by_client"] > 15 and result["completed"] > 0
    assert_nothing_lost_or_leaked(result)
    assert result["idle_after_drain_s"] <= 1.0, result["leaks_per_node"]
    assert result["router"]["router_aborts_total"] >= result["aborted_by_client"]


def test_a_node_restarted_under_its_id_leaves_no_old_block_in_the_index(chaos):
    result = chaos.fault("node_restart")
    assert_load_sent_and_completed(result, "node_restart", LEASE_TTL_S)
    assert result["blocks_before_kill"] > 0
    assert_nothing_lost_or_leaked(result)
    # gone with the re-registration, or with the lease if the restart took longer
    assert result["old_blocks_gone_after_s"] <= max(result["reregistered_after_s"],
                                                    LEASE_TTL_S + 1)


def test_a_churn_soak_keeps_every_process_flat(chaos):
    # unique prompts of 88 tokens (6 blocks): each node's 256-block cache fills within the
    # first quarter and evicts from then on
    result = chaos.soak(LoadSpec(rate=12.0, count=360, max_tokens=4, unique=True, seed=11))
    assert result["failed"] == 0 and result["completed"] == 360
    assert result["block_events_per_s"] > 50
    assert set(result["rss"]) == {"router", "metadata", "p0", "p1", "d0", "d1"}
    assert result["memory_flat"], result["rss"]
