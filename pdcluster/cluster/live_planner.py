"""The live planner's loop body, Ray-free: every interval it reads the router's metrics and the
nodes' loads (cluster.planner_signals), asks the pure planner (router.planning.planner) for
the targets, and moves the fleet toward them — starting nodes, or retiring one (a drain that
keeps the cache: cluster.node_fleet).

`Fleet` is what it needs of the nodes (`cluster.node_fleet.RayFleet` on Ray; tests may give
another): which nodes serve each role, their loads, start one, retire one. The node retired
is the cheapest to lose: one still starting, else the least busy.

API: `Fleet`, `LivePlanner`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from pdcluster.cluster.planner_settings import PlannerSettings
from pdcluster.cluster.planner_signals import NodeLoad, RouterWindow, signals
from pdcluster.router.planning.capacity import CapacityModel
from pdcluster.router.planning.planner import PlanDecision, Planner

logger = logging.getLogger(__name__)
ROLES = ("prefill", "decode")
OUTPUT_PRIOR_TOKENS = 200.0


class Fleet(Protocol):
    def serving(self, role: str) -> list[str]:
        """Nodes of `role` running or starting, not leaving."""
        ...

    def loads(self) -> list[NodeLoad]:
        """The load of every node that serves now (started, not leaving)."""
        ...

    def start(self, role: str) -> str:
        """Start a node of `role`; its id. It serves once started (asynchronously)."""
        ...

    def retire(self, node_id: str) -> None:
        """Drain `node_id` (hand-off, streams finish) and release it, in the background."""
        ...

    def starting(self) -> set[str]:
        """Nodes started but not serving yet."""
        ...


class LivePlanner:
    def __init__(self, settings: PlannerSettings, fleet: Fleet,
                 read_metrics: Callable[[], str] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_decision: Callable[[dict, dict[str, int]], None] | None = None) -> None:
        self.settings, self.fleet, self.read_metrics = settings, fleet, read_metrics
        # told each decision (`last`) and the nodes serving before it: the planner's metrics
        self.on_decision = on_decision
        self.model = CapacityModel()
        self.planner = Planner(settings.planner_config(), self.model, clock)
        self._window = RouterWindow()
        self._clock = clock
        self._last_at: float | None = None
        self._output_avg = OUTPUT_PRIOR_TOKENS
        self.events: list[dict] = []  # every change: time, targets, reasons
        self.last: dict | None = None  # the latest decision and what it was made from

    def set_slo_itl(self, slo_s: float) -> None:
        self.settings = replace(self.settings, slo_itl_ms=slo_s * 1000)
        self.planner.config = replace(self.planner.config, slo_itl_s=slo_s)

    def step(self) -> PlanDecision | None:
        """One decision (None until two scrapes of the router's metrics make a window)."""
        if self.read_metrics is None:
            return None
        stats = self._window.take(self.read_metrics())
        now = self._clock()
        last, self._last_at = self._last_at, now
        if stats is None or last is None:
            return None
        if stats.completed:
            per_request = stats.output_tokens / stats.completed
            self._output_avg = 0.8 * self._output_avg + 0.2 * per_request
        current = {role: len(self.fleet.serving(role)) for role in ROLES}
        sig = signals(stats, max(now - last, 1e-3), self.fleet.loads(), current["prefill"],
                      current["decode"], self.model, self._output_avg)
        decision = self.planner.decide(sig, now)
        self.last = {"at": now, "signals": {
            "rate_per_s": round(sig.rate_per_s, 3), "prefill_tokens": round(sig.prefill_tokens),
            "output_tokens": round(sig.output_tokens), "context_tokens": round(sig.context_tokens),
            "queued_prefill_tokens": sig.queued_prefill_tokens, "ttft_p90_s": sig.ttft_p90_s,
            "itl_p90_s": sig.itl_p90_s},
            "required": [decision.required_prefill, decision.required_decode],
            "targets": [decision.prefill, decision.decode],
            "planned_rate_per_s": round(decision.planned_rate_per_s, 3),
            "model": {"prefill_tokens_per_s": round(self.model.prefill_tokens_per_s),
                      "step_s": [float(f"{c:.4g}") for c in self.model.step_coefficients]},
            "reasons": list(decision.reasons)}
        if self.on_decision is not None:
            self.on_decision(self.last, current)
        targets = {"prefill": decision.prefill, "decode": decision.decode}
        for role in ROLES:
            self._move(role, current[role], targets[role])
        if decision.changes(current["prefill"], current["decode"]):
            self.events.append({"at": now, "prefill": decision.prefill,
                                "decode": decision.decode, "reasons": list(decision.reasons)})
            logger.info("planner: prefill %d -> %d, decode %d -> %d (%s)", current["prefill"],
                        decision.prefill, current["decode"], decision.decode,
                        "; ".join(decision.reasons))
        return decision

    def _move(self, role: str, current: int, target: int) -> None:
        for _ in range(target - current):
            self.fleet.start(role)
        for _ in range(current - target):
            self.fleet.retire(self._cheapest(role))

    def _cheapest(self, role: str) -> str:
        """The node of `role` whose loss costs least: still starting, else the least busy."""
        serving = self.fleet.serving(role)
        starting = self.fleet.starting()
        for node_id in reversed(serving):
            if node_id in starting:
                return node_id
        busy = {n.node_id: (n.num_running, n.queued_prefill_tokens) for n in self.fleet.loads()}
        return min(reversed(serving), key=lambda n: busy.get(n, (0, 0)))
