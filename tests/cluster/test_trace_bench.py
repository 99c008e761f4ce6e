"""`pdcluster bench trace` in a tiny configuration: a generated multi-turn session trace (a
few dozen requests) replayed on a live local cluster (Ray, 1 prefill + 1 decode node, the
metadata service, the router over real HTTP) once per routing policy, with the tiny random
model. Checks the JSON it prints and that every request of every policy completed."""

from __future__ import annotations

import json

from pdcluster.cluster.cli import main
from tests.cluster.trace_fixture import write_session_trace

POLICY_FIELDS = {"completed", "failed", "ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms",
                 "e2e_p90_ms", "output_tokens_per_s", "prefix_hit_ratio", "local_hit_ratio",
                 "prefix_queried_tokens", "prefix_hit_tokens", "blocks_transferred_p_to_d",
                 "blocks_pulled", "preemptions", "replay_hit_ratio", "replay_reuse_ratio",
                 "replay_work_imbalance", "wall_s"}


def test_trace_bench_runs_every_policy_live(tmp_path, capsys):
    trace = write_session_trace(tmp_path / "sessions.jsonl", num_sessions=5, num_turns=5)
    status = main(["bench", "trace", "--trace", str(trace), "--json", "--limit", "25",
                   "--num-prefill", "1", "--num-decode", "1", "--kv-blocks", "256",
                   "--tokens-per-block", "32", "--max-output-tokens", "4",
                   "--request-timeout", "60"])
    assert status == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["requests"] == 25 and result["tokens_per_trace_block"] == 32
    assert result["trace_block_tokens"] == 512 and result["model"].startswith("tiny")
    assert set(result["policies"]) == {"kv", "round_robin", "least_loaded"}
    for policy, figures in result["policies"].items():
        assert set(figures) >= POLICY_FIELDS, policy
        assert figures["completed"] == 25 and figures["failed"] == 0, (policy, figures)
        # every prompt was computed by some node and looked up in its prefix cache
        assert figures["prefix_queried_tokens"] >= 25 * 3 * 32, policy
    kv = result["policies"]["kv"]
    # turns extend earlier prompts: the KV policy finds them cached; long prompts move P->D
    assert kv["prefix_hit_ratio"] > 0.3 and kv["blocks_transferred_p_to_d"] > 0
    assert 0 < result["ideal_hit_ratio"] <= 1
    assert result["ttft_p50_ratio_kv_vs_round_robin"] > 0
    assert result["live_vs_replay_hit_ratio"] > 0


def test_trace_bench_host_tier_against_none_in_one_run(tmp_path, capsys):
    """Device pools too small for the sessions' prompts: between two turns of one session the
    other sessions evict its blocks from the device, and only a host tier keeps them."""
    trace = write_session_trace(tmp_path / "sessions.jsonl", num_sessions=5, num_turns=5)
    status = main(["bench", "trace", "--trace", str(trace), "--json", "--limit", "25",
                   "--num-prefill", "1", "--num-decode", "1", "--kv-blocks", "32",
                   "--host-blocks", "256", "--policies", "kv", "--tokens-per-block", "32",
                   "--max-output-tokens", "4", "--request-timeout", "60"])
    assert status == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tiered = result["with_host_tier"]
    assert tiered["host_blocks_per_node"] == 256
    kv, kv_tier = result["policies"]["kv"], tiered["kv"]
    assert kv_tier["completed"] == 25 and kv_tier["failed"] == 0, kv_tier
    # the host tier serves the prefixes the device pool lost, and the replay predicts it
    assert kv_tier["prefix_hit_ratio"] > kv["prefix_hit_ratio"], (kv, kv_tier)
    assert result["hit_ratio_host_tier_vs_none"] > 1.0
    assert kv_tier["replay_hit_ratio"] >= kv["replay_hit_ratio"]
    assert result["ttft_p50_ratio_host_tier_vs_none"] > 0
