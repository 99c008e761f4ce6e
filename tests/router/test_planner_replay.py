"""The planner's replay (router/sim/planner_replay.py): the `ramps` trace (a time-varying rate
with bursts and a moving mix), the simulated disaggregated cluster (router/sim/pd_sim.py) on
requests whose latencies can be worked out by hand, the pruned best-fixed search against
brute force, and `pdcluster replay --planner` end to end from outside the repository."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from pdcluster.router.sim import trace_gen
from pdcluster.router.sim.pd_sim import PDCluster, PDConfig, SimRequest, sim_requests
from pdcluster.router.sim.planner_replay import (
    PlannerReplayConfig,
    best_fixed,
    planner_report,
    run_fixed,
)
from pdcluster.router.sim.replay_config import parse_trace

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_request(at: float, uncached: int, output: int, prompt: int | None = None
                 ) -> SimRequest:
    return SimRequest(at, prompt or uncached, uncached, output)


# ---- the trace ---------------------------------------------------------------------------------

def per_minute(rows: list[dict]) -> list[int]:
    counts = [0] * (rows[-1]["timestamp"] // 60_000 + 1)
    for row in rows:
        counts[row["timestamp"] // 60_000] += 1
    return counts


def test_ramps_rise_burst_and_fall_with_a_moving_mix() -> None:
    rows = trace_gen.generate("ramps", seed=0)
    counts = per_minute(rows)
    early, peak, late = (statistics.mean(counts[a:b]) for a, b in ((1, 6), (25, 30), (53, 58)))
    assert peak > 3 * early and peak > 2 * late
    burst = counts[15]  # the first burst starts at 0.25 of the hour: minute 15
    assert burst > 1.5 * statistics.mean(counts[12:15])
    fifth = len(rows) // 5
    first, last = rows[:fifth], rows[-fifth:]
    fresh = [r.uncached_tokens for r in sim_requests(parse_trace(rows), 10**7)]
    assert statistics.mean(fresh[:fifth]) > 1.5 * statistics.mean(fresh[-fifth:])
    assert statistics.mean(r["output_length"] for r in last) \
        > 1.3 * statistics.mean(r["output_length"] for r in first)


def test_rate_profile_interpolates_and_bursts() -> None:
    profile = trace_gen.RateProfile(((0.0, 1.0), (0.5, 3.0), (1.0, 1.0)), ((0.5, 10.0),), 2.0)
    assert profile.multiplier(0.25, 25.0, 100.0) == pytest.approx(2.0)
    assert profile.multiplier(0.5, 50.0, 100.0) == pytest.approx(6.0)  # in the burst
    assert profile.multiplier(0.75, 75.0, 100.0) == pytest.approx(2.0)
    assert profile.peak == 6.0


# ---- the simulated cluster ---------------------------------------------------------------

def test_one_request_costs_what_the_model_says() -> None:
    cfg = PDConfig(prefill_fixed_s=0.0, step_base_s=0.01, step_per_seq_s=0.0,
                   step_per_ctx_token_s=0.0, transfer_bytes_per_s=131_072 * 10_000)
    cluster = PDCluster(cfg, [make_request(0.0, 10_000, 11)], 1, 1)
    end = cluster.run()
    # prefill 1 s, transfer 1 s, then 11 steps of 10 ms: the first after one step
    assert cluster.outcome.ttft[0] == pytest.approx(2.01)
    assert cluster.outcome.itl[0] == pytest.approx(0.01)
    assert end == pytest.approx(2.11)
    assert cluster.outcome.attainment() == 0.0  # TTFT 2.01 s > the 2 s SLO
    assert cluster.node_seconds(end) == pytest.approx(2 * 2.11)


def test_queues_batches_and_memory() -> None:
    cfg = PDConfig(prefill_fixed_s=0.0, step_base_s=0.01, step_per_seq_s=0.001,
                   step_per_ctx_token_s=0.0, max_batch=2, slo_ttft_s=10.0)
    reqs = [make_request(0.0, 5_000, 100) for _ in range(3)]
    cluster = PDCluster(cfg, reqs, 1, 1)
    cluster.run()
    ttft = cluster.outcome.ttft
    assert ttft[1] > ttft[0] + 0.49  # the second waits for the first's prefill
    assert ttft[2] > ttft[0] + 0.9  # the third also waits for a place in the batch
    # two sequences share the batch: 12 ms steps
    assert cluster.outcome.itl[0] == pytest.approx(0.012, rel=0.05)


def test_scaling_starts_late_and_drains_before_release() -> None:
    cfg = PDConfig(prefill_fixed_s=0.0, step_base_s=0.01, step_per_seq_s=0.0,
                   step_per_ctx_token_s=0.0, startup_s=5.0)
    reqs = [make_request(t, 10_000, 100) for t in (0.0, 6.0, 6.0)]
    cluster = PDCluster(cfg, reqs, 1, 2)
    cluster.add_prefill(0.0)  # ready at 5 s: takes one of the two requests at 6 s
    cluster.remove_decode(0.0)  # empty: released at once
    end = cluster.run()
    assert cluster.outcome.ttft[1] == pytest.approx(cluster.outcome.ttft[2], rel=0.01)
    assert cluster.outcome.ttft[1] < 1.2  # not queued behind each other
    assert [n.released_at for n in cluster.decode] == [0.0, None]
    assert cluster.node_seconds(end) == pytest.approx(3 * end)


def test_sim_requests_reuse_prefixes_from_one_pool() -> None:
    rows = [{"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 3]},
            {"timestamp": 10, "input_length": 2000, "output_length": 5,
             "hash_ids": [1, 2, 3, 4]}]
    first, second = sim_requests(parse_trace(rows), 100)
    assert (first.uncached_tokens, second.uncached_tokens) == (1500, 2000 - 3 * 512)
    _, small = sim_requests(parse_trace(rows), 2)  # 2 blocks: the tail went first
    assert small.uncached_tokens == 2000 - 2 * 512


# ---- the planner and the fixed search ----------------------------------------------------

def fast_nodes() -> PDConfig:
    """Nodes three times as fast as the defaults: the full `ramps` trace then needs few."""
    return PDConfig(prefill_tokens_per_s=30_000, step_base_s=0.004, step_per_seq_s=0.00007,
                    step_per_ctx_token_s=1.3e-8)


@pytest.fixture(scope="module")
def ramps_requests() -> list[SimRequest]:
    return sim_requests(parse_trace(trace_gen.generate("ramps", seed=0)), 100_000)


def test_the_pruned_search_finds_the_smallest_split(ramps_requests) -> None:
    config = PlannerReplayConfig(max_nodes=7, pd=fast_nodes())
    found = best_fixed(ramps_requests, config)
    assert len(found["searched"]) < 2 * config.max_nodes
    meeting = [p + d for p in range(1, 7) for d in range(1, 8 - p)
               if run_fixed(ramps_requests, config, p, d) is not None]
    assert found["prefill"] + found["decode"] == min(meeting)
    assert found["slo_attainment"] >= 0.95


def test_the_planner_meets_the_goal_on_ramps(ramps_requests) -> None:
    """The issue's goal, on the full trace: attainment >= 0.95 at <= 0.8x the node-seconds
    of the best fixed split (measured: 0.985 at 0.79x, seed 0)."""
    report = planner_report(ramps_requests, PlannerReplayConfig(max_nodes=16))
    planner, fixed = report["planner"], report["best_fixed"]
    assert planner["slo_attainment"] >= 0.95, planner
    assert report["node_seconds_over_best_fixed"] <= 0.8, report
    assert report["goal_met"]
    assert planner["scale_events"] == len(planner["events"]) > 4
    assert all(p >= 1 and d >= 1 and p + d <= 16 for _, p, d in planner["events"])
    assert planner["calibrated_prefill_tokens_per_s"] == pytest.approx(10_000, rel=0.1)
    assert fixed["prefill"] + fixed["decode"] <= 16


def test_replay_planner_from_the_command_line(tmp_path) -> None:
    trace = tmp_path / "ramps.jsonl"
    trace_gen.write_trace(trace_gen.generate("ramps", seed=1, scale=0.1), trace)
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "replay", "--trace", str(trace),
         "--planner", "--max-nodes", "8", "--slo-ttft-s", "2", "--slo-itl-ms", "50",
         "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("slo_attainment", "node_seconds", "scale_events", "events"):
        assert key in result["planner"]
    for key in ("prefill", "decode", "slo_attainment", "node_seconds", "searched"):
        assert key in result["best_fixed"]
    assert isinstance(result["goal_met"], bool) and result["max_nodes"] == 8


def test_bad_planner_arguments_are_usage_errors(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "replay", "--synthetic", "ramps",
         "--planner", "--max-nodes", "1"], cwd=tmp_path, capture_output=True, text=True,
        timeout=60, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "max_nodes" in proc.stderr
