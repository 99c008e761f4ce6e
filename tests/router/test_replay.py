"""The replay tool: the shared Mooncake trace and a synthetic multi-turn trace (target on both:
hit ratio >= 0.97 x ideal with work imbalance <= 1.10 on 8 nodes, 100,000 blocks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.core.block_index import BlockIndex
from pdcluster.router.replay import (
    ReplayConfig,
    SimNode,
    apply_events,
    ideal_hit_ratio,
    load_trace,
    replay,
    replay_all,
)
from tests.router.synth_trace import synthetic_trace

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO_ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"


def run_replay(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "replay", *args,
                           "--json"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not SHARED_TRACE.is_file(),
                    reason=f"shared trace not found at {SHARED_TRACE} (needs ../shared)")
def test_shared_trace_meets_the_target() -> None:
    result = run_replay("--trace", str(SHARED_TRACE), "--nodes", "8", "--cache-blocks", "100000")
    assert result["requests"] == 3993
    assert result["hit_ratio"] >= 0.97 * result["ideal_hit_ratio"], result
    assert result["work_imbalance"] <= 1.10, result
    for baseline in ("round-robin", "least-loaded"):
        assert result["hit_ratio"] > 1.5 * result[baseline]["hit_ratio"], result
    assert result["wall_s"] < 30


def test_synthetic_multi_turn_trace(tmp_path: Path) -> None:
    trace = synthetic_trace(tmp_path / "synth.jsonl", seed=0)
    result = run_replay("--trace", str(trace), "--nodes", "8", "--cache-blocks", "100000")
    assert result["hit_ratio"] >= 0.97 * result["ideal_hit_ratio"], result
    assert result["work_imbalance"] <= 1.10, result
    assert result["hit_ratio"] > result["round-robin"]["hit_ratio"] + 0.1


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_synthetic_trace_target_holds_on_other_seeds(tmp_path: Path, seed: int) -> None:
    requests = load_trace(synthetic_trace(tmp_path / "synth.jsonl", seed=seed))
    ideal = ideal_hit_ratio(requests)
    result = replay(requests, "kv", ReplayConfig(num_nodes=8))
    assert result["hit_ratio"] >= 0.97 * ideal, result
    assert result["work_imbalance"] <= 1.10, result
    # 16 nodes (~19% busy): 1.6-2.0 with the live load signal alone, about 1.1-1.25 with the
    # decayed work term
    wide = replay(requests, "kv", ReplayConfig(num_nodes=16))
    assert wide["hit_ratio"] >= 0.97 * ideal and wide["work_imbalance"] <= 1.35, wide


def test_baseline_policy_can_be_chosen(tmp_path: Path) -> None:
    trace = synthetic_trace(tmp_path / "synth.jsonl", num_conversations=60, seed=1)
    result = run_replay("--trace", str(trace), "--policy", "round-robin", "--nodes", "4",
                        "--cache-blocks", "400")
    assert result["policy"] == "round-robin"
    assert result["hit_ratio"] == result["round-robin"]["hit_ratio"]
    assert {"kv", "least-loaded"} <= result.keys()


def test_small_caches_evict_and_the_index_stays_exact(tmp_path: Path) -> None:
    requests = load_trace(synthetic_trace(tmp_path / "s.jsonl", num_conversations=80, seed=2))
    small = replay_all(requests, "kv", ReplayConfig(num_nodes=4, cache_blocks=80))
    large = replay_all(requests, "kv", ReplayConfig(num_nodes=4, cache_blocks=100_000))
    assert small["hit_ratio"] < large["hit_ratio"] <= large["ideal_hit_ratio"]


def test_lru_node_publishes_stored_and_removed_events() -> None:
    node, index = SimNode("a", capacity=3), BlockIndex()
    index.add_node("a")
    apply_events(index, "a", node.store((b"x" * 32, b"y" * 32)))
    assert index.query([b"x" * 32, b"y" * 32]) == [("a", 2)]
    apply_events(index, "a", node.store((b"z" * 32, b"w" * 32)))  # evicts the LRU tail: y
    assert index.node_blocks("a") == {b"x" * 32, b"z" * 32, b"w" * 32}
    assert set(node.cache) == index.node_blocks("a")


def test_ideal_hit_ratio_counts_leading_blocks_only(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
            {"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [9, 2]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert ideal_hit_ratio(load_trace(path)) == round(2 / 7, 4)


def test_missing_trace_is_a_usage_error() -> None:
    proc = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "replay", "--trace",
                           "/nope"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
