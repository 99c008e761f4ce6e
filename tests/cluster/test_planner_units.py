"""The live planner's parts without Ray: its settings (cluster.yaml `planner:`, the router's
`admission:`, `pdcluster serve --planner`), the signals read from the router's real metrics
text, and the loop body moving a fleet toward the planner's targets."""

from __future__ import annotations

import argparse

import pytest

from pdcluster.cluster.cli_planner import add_planner_args, planner_fields
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.live_planner import LivePlanner
from pdcluster.cluster.planner_settings import PlannerSettings
from pdcluster.cluster.planner_signals import NodeLoad, RouterWindow, signals
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.planning.capacity import CapacityModel


def test_cluster_yaml_planner_and_admission_sections(tmp_path) -> None:
    from tests.models import build_model_dirs

    model = build_model_dirs(tmp_path)["llama-gqa"]
    config = ClusterConfig.from_dict({
        "model": model, "num_prefill": 1, "num_decode": 2,
        "planner": {"enabled": True, "slo_ttft_s": 1.5, "prefill": {"min": 1, "max": 3},
                    "decode": {"min": 1, "max": 5}, "max_nodes": 6},
        "router": {"admission": {"slo_ttft_s": 1.5, "mode": "queue",
                                 "tenant_priorities": {"batch": "low"}}}})
    assert config.planner == PlannerSettings(slo_ttft_s=1.5, min_prefill=1, max_prefill=3,
                                             min_decode=1, max_decode=5, max_nodes=6)
    assert config.planner.most_nodes == 6
    assert config.admission is not None and config.admission.mode == "queue"
    assert config.admission.tenant_priorities == (("batch", "low"),)
    off = ClusterConfig.from_dict({"model": model, "planner": {"enabled": False}})
    assert off.planner is None and off.admission is None
    for bad in ({"planner": {"enabled": True, "cooldown": 3}},
                {"planner": {"enabled": True, "decode": {"min": 0, "max": 2}}},
                {"planner": {"enabled": True, "decode": {"min": 1, "max": 1}}, "num_decode": 2},
                {"router": {"admission": {"mode": "drop"}}}):
        with pytest.raises(ValueError):
            ClusterConfig.from_dict({"model": model, **bad})


def test_serve_flags_make_the_settings() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prefill", type=int, default=1)
    parser.add_argument("--num-decode", type=int, default=1)
    add_planner_args(parser)
    args = parser.parse_args(["--planner", "--max-decode", "6", "--slo-itl-ms", "40",
                              "--admission", "reject"])
    fields = planner_fields(args)
    assert fields["planner"].max_decode == 6 and fields["planner"].slo_itl_ms == 40
    assert fields["planner"].min_prefill == 1 and fields["planner"].max_prefill == 4
    assert fields["admission"].mode == "reject"
    assert planner_fields(parser.parse_args([])) == {}


def scrape(metrics: RouterMetrics) -> str:
    return metrics.render().decode()


def test_router_window_reads_deltas_and_p90s() -> None:
    metrics, window = RouterMetrics(), RouterWindow()
    metrics.requests.labels("chat", "200").inc(3)
    assert window.take(scrape(metrics)) is None  # the first scrape opens the window
    metrics.requests.labels("chat", "200").inc(8)
    metrics.requests.labels("completions", "429").inc(2)
    metrics.requests.labels("models", "200").inc(5)  # not a generation request
    metrics.prompt_tokens.inc(10_000)
    metrics.prefix_hit_tokens.inc(4_000)
    metrics.output_tokens.inc(800)
    for ttft in [0.05] * 8 + [3.0] * 2:
        metrics.ttft.observe(ttft)
    for itl in [0.02] * 10:
        metrics.itl.observe(itl)
    stats = window.take(scrape(metrics))
    assert stats is not None
    assert (stats.requests, stats.completed) == (10, 8)
    assert (stats.prompt_tokens, stats.cached_tokens, stats.output_tokens) == (10_000, 4_000,
                                                                                 800)
    assert stats.ttft_p90_s == 5.0  # the bucket holding the 90th percentile: (2.5, 5]
    assert stats.itl_p90_s == 0.025 and stats.itl_mean_s == pytest.approx(0.02)
    empty = window.take(scrape(metrics))
    assert empty is not None and empty.requests == 0 and empty.ttft_p90_s is None

    model = CapacityModel()
    loads = [NodeLoad("p0", "prefill", 3000, 1, 5000.0), NodeLoad("d0", "decode", 0, 4, None)]
    sig = signals(stats, 10.0, loads, 1, 1, model, output_avg=100)
    assert sig.rate_per_s == 1.0 and sig.prefill_tokens == 600  # (10,000 - 4,000) / 10
    assert sig.queued_prefill_tokens == 3000 and sig.ttft_p90_s == 5.0
    assert model.prefill_tokens_per_s < 10_000  # calibrating toward the node's 5,000


class FakeFleet:
    """A fleet that starts and retires at once, recording what it was asked."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.nodes = [f"p{i}" for i in range(prefill)] + [f"d{i}" for i in range(decode)]
        self.started: list[str] = []
        self.retired: list[str] = []

    def serving(self, role: str) -> list[str]:
        return [n for n in self.nodes if (n[0] == "p") == (role == "prefill")]

    def loads(self) -> list[NodeLoad]:
        return [NodeLoad(n, "prefill" if n[0] == "p" else "decode", 0, int(n[1:]), 10_000.0)
                for n in self.nodes]

    def start(self, role: str) -> str:
        node_id = f"{role[0]}{len(self.serving(role)) + len(self.retired)}"
        self.nodes.append(node_id)
        self.started.append(node_id)
        return node_id

    def retire(self, node_id: str) -> None:
        self.nodes.remove(node_id)
        self.retired.append(node_id)

    def starting(self) -> set[str]:
        return set()


def test_the_loop_body_moves_the_fleet() -> None:
    metrics, clock = RouterMetrics(), [0.0]
    settings = PlannerSettings(slo_itl_ms=50, interval_s=10, min_prefill=1, max_prefill=4,
                               min_decode=1, max_decode=4, down_cooldown_s=20,
                               down_window_s=20, rate_half_life_s=5)
    fleet = FakeFleet(1, 2)
    live = LivePlanner(settings, fleet, lambda: scrape(metrics), clock=lambda: clock[0])
    assert live.step() is None
    for _ in range(3):  # 40 long prompts a second: prefill-bound
        clock[0] += 10
        metrics.requests.labels("completions", "200").inc(400)
        metrics.prompt_tokens.inc(400 * 3000)
        metrics.output_tokens.inc(400 * 50)
        live.step()
    assert len(fleet.serving("prefill")) > 1 and fleet.started[0].startswith("p")
    for _ in range(12):  # then nothing
        clock[0] += 10
        live.step()
    assert len(fleet.serving("prefill")) == 1 and len(fleet.serving("decode")) == 1
    assert "d0" in fleet.retired  # the least busy decode node (it runs none, d1 one)
    assert live.events and live.events[0]["prefill"] > 1
