"""`PlannerSettings`: the live planner's settings, as cluster.yaml's `planner:` section and
`pdcluster serve --planner` give them; validated here, turned into the pure planner's
`PlannerConfig` (router.planning.planner) by `planner_config()`.

cluster.yaml:
    planner:
      enabled: true
      slo_ttft_s: 2.0
      slo_itl_ms: 50
      interval_s: 10           # between decisions
      startup_s: 30            # how long a node takes to serve: the planner plans this far ahead
      prefill: {min: 1, max: 4}
      decode: {min: 1, max: 4}
      max_nodes: 8             # prefill + decode at most (default: the sum of the maxima)
      down_cooldown_s: 60      # since a role's last change, before it scales in
      down_window_s: 180       # it scales in only below the largest need seen over this
      rate_half_life_s: 30     # of the arrival rate's average
      drain_timeout_s: 120     # a leaving node's streams and hand-off get this long
      router_url: http://router-admin:9091   # a router running elsewhere (its admin port)

API: `PlannerSettings`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.router.planning.planner import PlannerConfig, RoleBounds

_KEYS = {"enabled", "slo_ttft_s", "slo_itl_ms", "interval_s", "startup_s", "prefill", "decode",
         "max_nodes", "down_cooldown_s", "down_window_s", "rate_half_life_s",
         "drain_timeout_s", "router_url"}


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    slo_ttft_s: float = 2.0
    slo_itl_ms: float = 50.0
    interval_s: float = 10.0
    startup_s: float = 30.0
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    max_nodes: int | None = None
    down_cooldown_s: float = 60.0
    down_window_s: float = 180.0
    rate_half_life_s: float = 30.0  # of the arrival rate's average
    drain_timeout_s: float = 120.0
    # where the planner reads the router's /metrics and /health when the router runs
    # elsewhere (the chart: its admin Service); None: the launcher's own router
    router_url: str | None = None

    def __post_init__(self) -> None:
        if self.min_decode < 1:
            raise ValueError("the planner keeps at least one decode node (decode.min >= 1)")
        if self.drain_timeout_s <= 0 or self.startup_s < 0:
            raise ValueError("drain_timeout_s must be > 0 and startup_s >= 0")
        self.planner_config()  # ValueError for bad bounds, SLOs or intervals

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(slo_ttft_s=self.slo_ttft_s, slo_itl_s=self.slo_itl_ms / 1000.0,
                             prefill=RoleBounds(self.min_prefill, self.max_prefill),
                             decode=RoleBounds(self.min_decode, self.max_decode),
                             max_nodes=self.max_nodes, interval_s=self.interval_s,
                             lead_s=self.startup_s + self.interval_s,
                             down_cooldown_s=self.down_cooldown_s,
                             down_window_s=self.down_window_s,
                             rate_half_life_s=self.rate_half_life_s)

    @property
    def most_nodes(self) -> int:
        """The most node actors the planner may run at once."""
        most = self.max_prefill + self.max_decode
        return most if self.max_nodes is None else min(most, self.max_nodes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlannerSettings | None:
        """The settings of a `planner:` section; None when it is absent or not enabled."""
        unknown = set(data) - _KEYS
        if unknown:
            raise ValueError(f"unknown planner config keys: {sorted(unknown)}")
        if not data.get("enabled", False):
            return None
        prefill, decode = data.get("prefill") or {}, data.get("decode") or {}
        for name, bounds in (("prefill", prefill), ("decode", decode)):
            if set(bounds) - {"min", "max"}:
                raise ValueError(f"planner.{name} takes min and max only")
        fields = {k: data[k] for k in ("slo_ttft_s", "slo_itl_ms", "interval_s", "startup_s",
                                       "max_nodes", "down_cooldown_s", "down_window_s",
                                       "rate_half_life_s", "drain_timeout_s", "router_url")
                  if k in data}
        return cls(min_prefill=prefill.get("min", 1), max_prefill=prefill.get("max", 4),
                   min_decode=decode.get("min", 1), max_decode=decode.get("max", 4), **fields)
