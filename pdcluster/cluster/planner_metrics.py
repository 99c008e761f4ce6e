"""The live planner's decisions as Prometheus metrics, through Ray's own metrics export
(`ray.util.metrics`): the planner actor runs on the Ray head, whose metrics port the chart
already scrapes (k8s/templates/monitoring.yaml), so no new port serves them. Ray prefixes each
name with `ray_`; the Grafana dashboard (k8s/dashboards/pdcluster.json, row "Planner") plots
them and marks every scale event as an annotation.

    pdcluster_planner_nodes{role, state}       nodes per role: serving (now), required (the
                                                model's need), target (after hysteresis, bounds)
    pdcluster_planner_scale_events_total{role, direction}   nodes started (up) or retired (down)
    pdcluster_planner_planned_rate              requests/s the decision planned for
    pdcluster_planner_observed_seconds{slo}     p90 TTFT and ITL in the window decided on
    pdcluster_planner_prefill_tokens_per_second the calibrated prefill rate of one node

API: `PlannerMetrics` (`record`), `PLANNER_METRICS` (the names).
"""

from __future__ import annotations

from typing import Any

PLANNER_METRICS = ("pdcluster_planner_nodes", "pdcluster_planner_scale_events",
                   "pdcluster_planner_planned_rate", "pdcluster_planner_observed_seconds",
                   "pdcluster_planner_prefill_tokens_per_second")


class PlannerMetrics:
    """Records each decision (`LivePlanner.last`'s form) in Ray's metrics; build it inside a
    Ray worker (the planner actor)."""

    def __init__(self) -> None:
        from ray.util.metrics import Counter, Gauge

        nodes, events, rate, observed, prefill = PLANNER_METRICS
        self._nodes = Gauge(nodes, "Nodes per role: serving now, required by the capacity "
                            "model, targeted after hysteresis and bounds",
                            tag_keys=("role", "state"))
        self._events = Counter(events, "Nodes the planner started (up) or retired (down)",
                               tag_keys=("role", "direction"))
        self._rate = Gauge(rate, "Requests per second the latest decision planned for")
        self._observed = Gauge(observed, "p90 TTFT and inter-token latency in the window the "
                               "latest decision was made from (seconds)", tag_keys=("slo",))
        self._prefill = Gauge(prefill, "Calibrated prefill tokens per second of one node")

    def record(self, last: dict[str, Any], serving: dict[str, int]) -> None:
        """One decision: `last` as `LivePlanner.last`, `serving` the nodes per role before it."""
        for i, role in enumerate(("prefill", "decode")):
            target = last["targets"][i]
            for state, value in (("serving", serving[role]), ("required", last["required"][i]),
                                 ("target", target)):
                self._nodes.set(value, tags={"role": role, "state": state})
            if target != serving[role]:
                direction = "up" if target > serving[role] else "down"
                self._events.inc(abs(target - serving[role]),
                                 tags={"role": role, "direction": direction})
        self._rate.set(last["planned_rate_per_s"])
        for slo, key in (("ttft", "ttft_p90_s"), ("itl", "itl_p90_s")):
            value = last["signals"].get(key)
            if value is not None:
                self._observed.set(value, tags={"slo": slo})
        self._prefill.set(last["model"]["prefill_tokens_per_s"])
