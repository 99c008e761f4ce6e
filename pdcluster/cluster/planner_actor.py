"""`PlannerActor`: the live planner as a Ray actor beside the launcher. It owns the node fleet
once the launcher has started the first nodes (cluster.node_fleet.RayFleet), reads the
router's metrics and /health over HTTP (the router's own endpoints, behind its API key) and
the nodes' loads through their actors, and every `interval_s` runs one decision
(cluster.live_planner.LivePlanner) on a thread of its own. Each decision is exported as
metrics through Ray's metrics port (cluster.planner_metrics).

    planner = ray.remote(PlannerActor).options(name="pdcluster-planner", num_cpus=0,
                                               max_concurrency=8).remote(
        config, metadata_address, cluster_secret, {"p0": "pdcluster-p0", ...})
    planner.attach_router.remote("http://127.0.0.1:8000", api_key)   # starts the loop
    planner.status.remote()     # decisions, nodes serving / starting, retired nodes
    planner.shutdown.remote()   # stop deciding, drain every node

Node actors the planner starts are its own (they go when it goes); the launcher hands it the
first ones by name.

API: `PlannerActor`, `metrics_reader`.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.live_planner import ROLES, LivePlanner
from pdcluster.cluster.node_fleet import RayFleet, router_health_reader
from pdcluster.cluster.planner_metrics import PlannerMetrics
from pdcluster.core.credentials import ClusterSecret

logger = logging.getLogger(__name__)


def metrics_reader(base_url: str, api_key: str | None) -> Callable[[], str]:
    """A reader of the router's Prometheus text (`base_url`: http://host:port)."""
    def read() -> str:
        request = urllib.request.Request(f"{base_url}/metrics")
        if api_key:
            request.add_header("Authorization", f"Bearer {api_key}")
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read().decode()
    return read


class PlannerActor:
    def __init__(self, config: ClusterConfig, metadata_address: str,
                 cluster_secret: ClusterSecret | None, node_names: dict[str, str]) -> None:
        import ray

        assert config.planner is not None, "a planner actor needs planner settings"
        self.settings = config.planner
        actors = {node_id: ray.get_actor(name) for node_id, name in node_names.items()}
        self.fleet = RayFleet(config, metadata_address, cluster_secret, actors,
                              self.settings.drain_timeout_s)
        self.live = LivePlanner(self.settings, self.fleet, on_decision=PlannerMetrics().record)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ping(self) -> bool:
        return True

    def attach_router(self, base_url: str, api_key: str | None = None,
                      run_loop: bool = True) -> None:
        """Read signals from the router at `base_url` (http://host:port); with `run_loop`,
        decide every interval from now on."""
        self.live.read_metrics = metrics_reader(base_url, api_key)
        self.fleet.router_health = router_health_reader(base_url, api_key)
        if run_loop and self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="planner")
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.interval_s):
            try:
                self.live.step()
            except Exception:  # a bad round (a node unreachable) must not end planning
                logger.exception("planner step failed")

    def step(self) -> dict | None:
        """One decision now (benchmarks and tests drive the planner this way)."""
        decision = self.live.step()
        return None if decision is None else {
            "prefill": decision.prefill, "decode": decision.decode,
            "required_prefill": decision.required_prefill,
            "required_decode": decision.required_decode,
            "planned_rate_per_s": decision.planned_rate_per_s,
            "reasons": list(decision.reasons)}

    def set_slo_itl(self, slo_s: float) -> None:
        """Change the ITL SLO (a benchmark sets it from a baseline it measured)."""
        self.live.set_slo_itl(slo_s)

    def status(self) -> dict[str, Any]:
        return {"events": list(self.live.events), "last": self.live.last,
                "serving": {role: self.fleet.serving(role) for role in ROLES},
                "starting": sorted(self.fleet.starting()),
                "retired": list(self.fleet.retired)}

    def nodes(self) -> list[dict[str, str]]:
        return self.fleet.info()

    def pause(self, timeout_s: float = 30.0) -> None:
        """Stop deciding (the nodes stay as they are, retirements under way finish)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.fleet.wait_retired(timeout_s)

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.pause(timeout_s)
        self.fleet.shutdown(timeout_s)
