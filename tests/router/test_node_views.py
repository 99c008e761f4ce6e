"""`NodeViews`: the policy's views stay exactly what rebuilding them from the node clients
would give (hits, load fields, health, load), within the documented recent-work step."""

from __future__ import annotations

import math

import pytest

from pdcluster.core.node_wire import LoadReport
from pdcluster.router.config import NodeSpec
from pdcluster.router.routing.load_decay import DecayedWork
from pdcluster.router.routing.node_views import DECAY_STEPS, NodeViews
from pdcluster.router.routing.policy import NodeView, PolicyConfig, load_cost

CONFIG = PolicyConfig(work_half_life_s=64.0)


class StubClient:
    """What NodeViews reads of a router.routing.node_link.NodeLink (no socket needed)."""

    def __init__(self, node_id: str, role: str = "both") -> None:
        self.spec = NodeSpec(node_id, role, "tcp://127.0.0.1:9")
        self.node_id, self.report, self.healthy = node_id, None, True
        self.pending_tokens, self.num_inflight, self.version = 0, 0, 0

    def set(self, **fields: object) -> None:
        for name, value in fields.items():
            setattr(self, name, value)
        self.version += 1


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def rebuilt(client: StubClient, hits: dict[str, int], work: DecayedWork, now: float) -> NodeView:
    """The view built from scratch, as the router did before views were kept."""
    report = client.report
    view = NodeView(client.node_id, client.spec.role, hits.get(client.node_id, 0),
                    client.pending_tokens + (report.queued_prefill_tokens if report else 0),
                    max(client.num_inflight, report.num_running if report else 0),
                    1 - report.num_free_blocks / report.num_total_blocks if report else 0.0,
                    bool(report and report.draining), work.value(client.node_id, now))
    view.load = load_cost(view, CONFIG)
    return view


@pytest.fixture
def setup():
    clock, work = Clock(), DecayedWork(CONFIG.work_half_life_s)
    clients = [StubClient(f"n{i}") for i in range(4)]
    views = NodeViews(work, CONFIG, clock)
    for client in clients:
        views.add(client)
    return clock, work, clients, views


def test_views_match_a_rebuild_through_every_kind_of_change(setup) -> None:
    clock, work, clients, views = setup
    hits = {"n1": 3, "n2": 1}
    assert views.current(hits) == [rebuilt(c, hits, work, clock.now) for c in clients]
    clients[0].set(report=LoadReport("n0", "both", 1, 2, 60, 100, 700), pending_tokens=50)
    clients[3].set(num_inflight=5)
    work.add("n2", 1000.0, clock.now)
    views.charged("n2")
    hits = {"n0": 7}  # n1's and n2's hits of the previous request are gone
    assert views.current(hits) == [rebuilt(c, hits, work, clock.now) for c in clients]
    clients[1].set(healthy=False)
    assert [v.node_id for v in views.current({})] == ["n0", "n2", "n3"]


def test_recent_work_is_re_decayed_every_step(setup) -> None:
    clock, work, clients, views = setup
    views.current({})  # re-decays everything now
    work.add("n1", 1000.0, clock.now)
    views.charged("n1")
    step = CONFIG.work_half_life_s / DECAY_STEPS
    clock.now += step * 0.9  # within a step: the value may be stale, by less than ln2/STEPS
    (view,) = [v for v in views.current({}) if v.node_id == "n1"]
    exact = work.value("n1", clock.now)
    assert exact < view.recent_work <= exact * (1 + math.log(2) / DECAY_STEPS)
    clock.now += step * 0.2  # past the step: exact again
    (view,) = [v for v in views.current({}) if v.node_id == "n1"]
    assert view.recent_work == pytest.approx(work.value("n1", clock.now), rel=1e-12)
    assert view.load == load_cost(view, CONFIG)
