"""`pdcluster replay --planner`: the planner (router.planning.planner, the class the live
planner runs) on a trace over the simulated disaggregated cluster (router.sim.pd_sim), and in
the same run the best fixed split it is measured against.

The planner decides every `interval_s` of trace time from signals read off the simulated
cluster the way the live planner reads them off the router and the nodes' metrics: arrivals
and their uncached prompt tokens over the window (the router knows each request's cached
part when it routes it), the output length of finished requests (an exponential average),
the KV context of decoding sequences, the prefill backlog, the window's TTFT and ITL p90; and
it calibrates its capacity model online from each node's busy time and computed tokens and
from each decode node's current step (batch, context, step time). Its targets start and
drain simulated nodes; a started node serves after `PDConfig.startup_s`.

`best_fixed`: the fixed (prefill, decode) split with the fewest nodes (at most `max_nodes`)
whose attainment is at least `target_attainment`. Attainment grows with either count, so the
least decode count that suffices does not grow with the prefill count: a staircase walk
(prefill up, decode down) visits O(max_nodes) splits, skipping any split no smaller than the
best found so far; and a run stops as soon as its misses exceed the target's allowance.

API: `PlannerReplayConfig`, `run_planner`, `run_fixed`, `best_fixed`, `planner_report`,
`planner_config(args)`, `run(args)` (`pdcluster replay --planner`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pdcluster.router.planning.capacity import CapacityModel
from pdcluster.router.planning.planner import Planner, PlannerConfig, RoleBounds, Signals
from pdcluster.router.sim.pd_sim import PDCluster, PDConfig, SimRequest, sim_requests
from pdcluster.router.sim.replay_config import parse_trace

OUTPUT_PRIOR_TOKENS = 300.0


@dataclass(frozen=True, slots=True)
class PlannerReplayConfig:
    max_nodes: int = 16
    pd: PDConfig = field(default_factory=PDConfig)
    interval_s: float = 10.0
    target_attainment: float = 0.95

    def __post_init__(self) -> None:
        if self.max_nodes < 2:
            raise ValueError(f"max_nodes must be >= 2 (a prefill and a decode node), got "
                             f"{self.max_nodes}")
        if not self.interval_s > 0 or not 0 < self.target_attainment <= 1:
            raise ValueError("interval_s must be > 0 and target_attainment in (0, 1]")

    def planner_config(self) -> PlannerConfig:
        most = self.max_nodes - 1
        return PlannerConfig(slo_ttft_s=self.pd.slo_ttft_s, slo_itl_s=self.pd.slo_itl_s,
                             prefill=RoleBounds(1, most), decode=RoleBounds(1, most),
                             max_nodes=self.max_nodes, interval_s=self.interval_s,
                             lead_s=self.pd.startup_s + self.interval_s)


class _SignalTap:
    """The planner's signals, read off a running simulated cluster once per interval."""

    def __init__(self, cluster: PDCluster, model: CapacityModel, interval_s: float) -> None:
        self.cluster, self.model, self.interval_s = cluster, model, interval_s
        self._arrived = self._firsts = self._finishes = 0
        self._output = OUTPUT_PRIOR_TOKENS
        self._busy = {id(n): (0.0, 0.0) for n in cluster.prefill}
        self._last = cluster.start_s

    def signals(self, now: float) -> Signals:
        c, reqs = self.cluster, self.cluster.requests
        start = self._arrived
        while self._arrived < len(reqs) and reqs[self._arrived].arrival_s <= now:
            self._arrived += 1
        window = reqs[start:self._arrived]
        firsts, self._firsts = c.first_log[self._firsts:], len(c.first_log)
        finishes, self._finishes = c.finish_log[self._finishes:], len(c.finish_log)
        ttfts = [t for _, i in firsts if (t := c.outcome.ttft[i]) is not None]
        itls = [t for _, i in finishes if (t := c.outcome.itl[i]) is not None]
        for _, index in finishes:
            self._output = 0.98 * self._output + 0.02 * reqs[index].output_tokens
        self._calibrate()
        window_s, self._last = max(now - self._last, self.interval_s), now
        uncached = sum(r.uncached_tokens for r in window) / len(window) if window else 0.0
        return Signals(window_s, len(window), uncached, self._output,
                       self._context(window), len(c.serving(c.prefill)),
                       len(c.serving(c.decode)), self._backlog(now), _p90(ttfts), _p90(itls))

    def _context(self, window: list[SimRequest]) -> float:
        running = [n for n in self.cluster.decode if n.batch]
        seqs = sum(len(n.batch) for n in running)
        if seqs:
            return sum(n.ctx for n in running) / seqs
        if window:
            return sum(r.input_tokens for r in window) / len(window) + self._output / 2
        return 1.0

    def _backlog(self, now: float) -> float:
        rate = self.cluster.config.prefill_tokens_per_s
        # a starting node's queue "ends" when it is ready: no backlog of its own
        return sum(max(0.0, n.busy_until - max(now, n.ready_at)) * rate
                   for n in self.cluster.prefill if not n.draining)

    def _calibrate(self) -> None:
        for p_node in self.cluster.prefill:
            busy, computed = self._busy.get(id(p_node), (0.0, 0.0))
            self.model.observe_prefill(p_node.computed - computed, p_node.busy_s - busy)
            self._busy[id(p_node)] = (p_node.busy_s, p_node.computed)
        for d_node in self.cluster.decode:
            if d_node.batch:
                self.model.observe_step(len(d_node.batch), d_node.ctx, d_node.step_s())


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def run_planner(requests: list[SimRequest], config: PlannerReplayConfig) -> dict:
    """The planner over the trace: attainment, node-seconds, its scale events."""
    start_s = requests[0].arrival_s if requests else 0.0
    cluster = PDCluster(config.pd, requests, 1, 1, start_s)
    model = CapacityModel()
    planner = Planner(config.planner_config(), model)
    tap = _SignalTap(cluster, model, config.interval_s)
    events: list[list[float]] = []

    def tick(now: float) -> None:
        signals = tap.signals(now)
        decision = planner.decide(signals, now)
        _apply(cluster, now, signals.num_prefill, decision.prefill, "prefill")
        _apply(cluster, now, signals.num_decode, decision.decode, "decode")
        if decision.changes(signals.num_prefill, signals.num_decode):
            events.append([round(now - start_s, 1), decision.prefill, decision.decode])

    end_s = cluster.run(tick, config.interval_s)
    result = _summary(cluster, start_s, end_s)
    span = max(end_s - start_s, 1e-9)
    result.update({"scale_events": len(events), "events": events,
                   "mean_nodes": round(result["node_seconds"] / span, 2),
                   "peak_nodes": max((p + d for _, p, d in events), default=2),
                   "calibrated_prefill_tokens_per_s": round(model.prefill_tokens_per_s),
                   "calibrated_step_s": [float(f"{c:.4g}") for c in model.step_coefficients]})
    return result


def _apply(cluster: PDCluster, now: float, current: int, target: int, role: str) -> None:
    for _ in range(target - current):
        (cluster.add_prefill if role == "prefill" else cluster.add_decode)(now)
    for _ in range(current - target):
        (cluster.remove_prefill if role == "prefill" else cluster.remove_decode)(now)


def run_fixed(requests: list[SimRequest], config: PlannerReplayConfig, num_prefill: int,
              num_decode: int, stop_early: bool = True) -> dict | None:
    """A fixed split over the trace; None when it cannot reach the target attainment (the
    run stopped once its misses exceeded the allowance)."""
    start_s = requests[0].arrival_s if requests else 0.0
    cluster = PDCluster(config.pd, requests, num_prefill, num_decode, start_s)
    allowance = math.floor((1 - config.target_attainment) * len(requests))
    end_s = cluster.run(max_misses=allowance if stop_early else None)
    if end_s < 0:
        return None
    return {"prefill": num_prefill, "decode": num_decode,
            **_summary(cluster, start_s, end_s)}


def best_fixed(requests: list[SimRequest], config: PlannerReplayConfig) -> dict:
    """The smallest fixed split meeting the target (module docstring); `searched` lists
    every split run and whether it met the target."""
    best: dict | None = None
    searched: list[list] = []

    def meets(p: int, d: int) -> dict | None:
        result = run_fixed(requests, config, p, d)
        ok = result is not None and result["slo_attainment"] >= config.target_attainment
        searched.append([p, d, ok])
        return result if ok else None

    n, d = config.max_nodes, config.max_nodes - 1
    for p in range(1, n):
        d = min(d, n - p)
        if best is not None:  # only a split smaller than the best is worth a run
            d = min(d, best["prefill"] + best["decode"] - p - 1)
            if d < 1:
                break
        found = meets(p, d)
        if found is None:
            continue
        while d > 1:
            fewer = meets(p, d - 1)
            if fewer is None:
                break
            found, d = fewer, d - 1
        best = found
    return {**(best or {"prefill": None, "decode": None, "slo_attainment": None,
                        "node_seconds": None}), "searched": searched}


def _summary(cluster: PDCluster, start_s: float, end_s: float) -> dict:
    ttfts = sorted(v for v in cluster.outcome.ttft if v is not None)
    itls = sorted(v for v in cluster.outcome.itl if v is not None)
    return {"slo_attainment": round(cluster.outcome.attainment(), 4),
            "node_seconds": round(cluster.node_seconds(end_s)),
            "ttft_p50_s": _q(ttfts, 0.5), "ttft_p90_s": _q(ttfts, 0.9),
            "itl_p50_ms": round(_q(itls, 0.5) * 1000, 2),
            "itl_p90_ms": round(_q(itls, 0.9) * 1000, 2)}


def _q(ordered: list[float], q: float) -> float:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else 0.0


def planner_report(requests: list[SimRequest], config: PlannerReplayConfig) -> dict:
    """The planner and the best fixed split, measured in one run, and the goal: attainment
    >= the target at <= 0.8x the best fixed split's node-seconds."""
    planner = run_planner(requests, config)
    fixed = best_fixed(requests, config)
    ratio = (round(planner["node_seconds"] / fixed["node_seconds"], 4)
             if fixed["node_seconds"] else None)
    return {"requests": len(requests), "max_nodes": config.max_nodes,
            "slo_ttft_s": config.pd.slo_ttft_s, "slo_itl_ms": config.pd.slo_itl_s * 1000,
            "startup_s": config.pd.startup_s, "interval_s": config.interval_s,
            "planner": planner, "best_fixed": fixed,
            "node_seconds_over_best_fixed": ratio,
            "goal_met": bool(ratio is not None and ratio <= 0.8
                             and planner["slo_attainment"] >= config.target_attainment)}


def planner_config(args) -> PlannerReplayConfig:
    """The configuration of parsed `pdcluster replay --planner` arguments (ValueError if
    invalid)."""
    pd = PDConfig(slo_ttft_s=args.slo_ttft_s, slo_itl_s=args.slo_itl_ms / 1000.0,
                  startup_s=args.startup_s, cache_blocks=args.cache_blocks)
    return PlannerReplayConfig(max_nodes=args.max_nodes, pd=pd,
                               interval_s=args.planner_interval_s)


def run(args, rows: list[dict]) -> dict:
    """`pdcluster replay --planner` on the trace `rows`."""
    started = time.perf_counter()
    config = planner_config(args)
    requests = sim_requests(parse_trace(rows), config.pd.cache_blocks)
    if not requests:
        raise ValueError("the trace is empty")
    result = planner_report(requests, config)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    return result
