"""The planner's decision: from the cluster's recorded signals and the calibrated capacity
model (router.planning.capacity) to how many prefill and how many decode nodes should run.
Pure: the caller gives it signals and a clock; it returns a `PlanDecision` and keeps only the
history its hysteresis needs. The live planner (cluster/planner_actor.py) and the replay
(router/sim/pd_sim.py) run this same class.

Every `decide(signals)`:

1. The arrival rate to plan for: the larger of the last window's rate and its exponential
   average, and, when the rate has been rising, its linear trend carried `lead_s` ahead (a
   node started now serves only after its start-up: plan for then), adding at most
   `max_trend_gain` of the rate (a recovery from a dip is a steep but short "trend").
2. Required nodes per role (`CapacityModel.prefill_nodes` / `decode_nodes`) for that rate with
   `headroom`, the request mix of the recent past (uncached prompt tokens, output tokens,
   context per request) and the prefill backlog now.
3. Feedback: when the measured TTFT (ITL) p90 of the window missed its SLO although the
   model says the current count suffices, the model is wrong about this load: one more
   node of that role is asked for than the current count.
4. Hysteresis per role: a larger target applies at once (after `up_cooldown_s` since the
   role's last change); a smaller one only after `down_cooldown_s` since the last change,
   and only down to the largest requirement seen over the last `down_window_s` (a dip
   shorter than the window moves nothing), at most `max_down_step` nodes at a time.
   Scale-in also needs the load with `down_band` more to fit the smaller count (two
   thresholds, up and down: noise around one boundary moves nothing). Targets stay within
   [min, max] per role; with `max_nodes`, the sum is capped: the nodes each role runs and
   still wants stay, and the room left is shared in proportion to what each role asks for
   above that (no node is drained in one role to be started in the other).

API: `PlannerConfig`, `Signals`, `PlanDecision`, `Planner`, `RoleBounds`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pdcluster.router.planning.capacity import CapacityModel, Workload

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True)
class RoleBounds:
    min_nodes: int = 1
    max_nodes: int = 8

    def __post_init__(self) -> None:
        if not 0 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 0 <= min <= max, got [{self.min_nodes}, "
                             f"{self.max_nodes}]")

    def clamp(self, n: int) -> int:
        return max(self.min_nodes, min(self.max_nodes, n))


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    slo_ttft_s: float = 2.0
    slo_itl_s: float = 0.05
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    max_nodes: int | None = None  # prefill + decode at most; None: the roles' max
    interval_s: float = 10.0  # how often the caller decides
    lead_s: float = 40.0  # plan for the rate this far ahead: a node's start-up + an interval
    max_trend_gain: float = 0.5  # the trend adds at most this share of the rate
    headroom: float = 0.1  # plan for the rate x (1 + headroom)
    # scale in only when the rate x (1 + headroom + down_band) fits fewer nodes: the gap
    # between the thresholds up and down is the hysteresis band
    down_band: float = 0.2
    wait_miss: float = 0.02  # P(TTFT > SLO) a mean prompt may have from queueing
    decode_z: float = 2.0  # standard deviations of the decoding count covered
    rate_half_life_s: float = 30.0  # of the rate's exponential average
    trend_window_s: float = 120.0  # the rate's trend is fitted over this much history
    up_cooldown_s: float = 0.0
    down_cooldown_s: float = 60.0
    down_window_s: float = 180.0
    max_down_step: int = 1

    def __post_init__(self) -> None:
        if not (self.slo_ttft_s > 0 and self.slo_itl_s > 0 and self.interval_s > 0):
            raise ValueError("SLOs and interval_s must be > 0")
        for name in ("lead_s", "max_trend_gain", "headroom", "down_band", "up_cooldown_s",
                     "down_cooldown_s", "down_window_s", "decode_z", "trend_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.wait_miss < 1 or not self.rate_half_life_s > 0:
            raise ValueError("wait_miss must be in (0, 1) and rate_half_life_s > 0")
        if self.max_down_step < 1:
            raise ValueError(f"max_down_step must be >= 1, got {self.max_down_step}")
        floor = self.prefill.min_nodes + self.decode.min_nodes
        if self.max_nodes is not None and self.max_nodes < max(floor, 1):
            raise ValueError(f"max_nodes {self.max_nodes} is below the roles' minimums {floor}")

    def bounds(self, role: str) -> RoleBounds:
        return self.prefill if role == PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class Signals:
    """What the cluster measured over the last window (from the router and the nodes'
    metrics): arrivals and their mix, the queues now, the latencies seen."""

    window_s: float
    arrivals: int
    prefill_tokens: float  # uncached prompt tokens per request, mean over the window
    output_tokens: float  # output tokens per request, mean over recent finished requests
    context_tokens: float  # KV tokens a decoding sequence holds, mean
    num_prefill: int  # nodes serving or starting (not draining)
    num_decode: int
    queued_prefill_tokens: float = 0.0
    ttft_p90_s: float | None = None  # None: no request finished its prefill in the window
    itl_p90_s: float | None = None

    @property
    def rate_per_s(self) -> float:
        return self.arrivals / self.window_s if self.window_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class PlanDecision:
    prefill: int
    decode: int
    required_prefill: int  # the model's requirement before hysteresis and bounds
    required_decode: int
    planned_rate_per_s: float
    reasons: tuple[str, ...] = ()

    def changes(self, num_prefill: int, num_decode: int) -> bool:
        return (self.prefill, self.decode) != (num_prefill, num_decode)


class Planner:
    """Targets for both roles, one decision per interval (module docstring)."""

    def __init__(self, config: PlannerConfig, model: CapacityModel | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.model = model or CapacityModel()
        self._clock = clock
        self._rate_avg: float | None = None
        self._rates: deque[tuple[float, float]] = deque()
        self._required: dict[str, deque[tuple[float, int]]] = {PREFILL: deque(),
                                                                 DECODE: deque()}
        # a start counts as a change: no scale-in before a cool-down's worth of signals
        self._changed_at: dict[str, float] | None = None

    def decide(self, signals: Signals, now: float | None = None) -> PlanDecision:
        now = self._now(now)
        if self._changed_at is None:
            self._changed_at = {PREFILL: now, DECODE: now}
        rate = self._planned_rate(signals, now)
        load = Workload(rate, signals.prefill_tokens, signals.output_tokens,
                        signals.context_tokens, signals.queued_prefill_tokens)
        reasons: list[str] = []
        required = {PREFILL: self._required_prefill(load), DECODE: self._required_decode(load)}
        keep = replace(load, rate_per_s=rate * (1 + self.config.down_band))
        # the count the load would need with `down_band` more: what scale-in must stay above
        kept = {PREFILL: self._required_prefill(keep), DECODE: self._required_decode(keep)}
        current = {PREFILL: signals.num_prefill, DECODE: signals.num_decode}
        for role, seen, slo in ((PREFILL, signals.ttft_p90_s, self.config.slo_ttft_s),
                                (DECODE, signals.itl_p90_s, self.config.slo_itl_s)):
            if seen is not None and seen > slo and required[role] <= current[role]:
                required[role] = current[role] + 1
                reasons.append(f"{role}: measured p90 {seen:.3g}s over the SLO")
        targets = {role: self._target(role, required[role], max(kept[role], required[role]),
                                      current[role], now, reasons)
                   for role in (PREFILL, DECODE)}
        targets = self._cap(targets, current, reasons)
        for role in (PREFILL, DECODE):
            if targets[role] != current[role]:
                self._changed_at[role] = now
        return PlanDecision(targets[PREFILL], targets[DECODE], required[PREFILL],
                            required[DECODE], rate, tuple(reasons))

    def _now(self, now: float | None) -> float:
        if now is not None:
            return now
        if self._clock is None:
            raise ValueError("a planner without a clock needs `now`")
        return self._clock()

    def _planned_rate(self, signals: Signals, now: float) -> float:
        rate, cfg = signals.rate_per_s, self.config
        if self._rate_avg is None:
            self._rate_avg = rate
        else:
            keep = 0.5 ** (signals.window_s / cfg.rate_half_life_s)
            self._rate_avg = keep * self._rate_avg + (1 - keep) * rate
        self._rates.append((now, rate))
        while self._rates and self._rates[0][0] < now - cfg.trend_window_s:
            self._rates.popleft()
        planned = max(rate, self._rate_avg)
        slope, fitted = _trend(self._rates, now)
        if slope > 0:  # capped: the recovery from a dip also looks like a ramp
            ahead = min(fitted + slope * cfg.lead_s, planned * (1 + cfg.max_trend_gain))
            planned = max(planned, ahead)
        return planned * (1 + cfg.headroom)

    def _required_prefill(self, load: Workload) -> int:
        cfg = self.config
        return self.model.prefill_nodes(load, cfg.slo_ttft_s, cfg.wait_miss,
                                        self._most(PREFILL))

    def _required_decode(self, load: Workload) -> int:
        cfg = self.config
        return self.model.decode_nodes(load, cfg.slo_itl_s, cfg.decode_z, self._most(DECODE))

    def _most(self, role: str) -> int:
        return self.config.bounds(role).max_nodes

    def _target(self, role: str, required: int, kept: int, current: int, now: float,
                reasons: list[str]) -> int:
        cfg, bounds = self.config, self.config.bounds(role)
        history = self._required[role]
        history.append((now, kept))
        while history and history[0][0] < now - cfg.down_window_s:
            history.popleft()
        need = bounds.clamp(required)
        assert self._changed_at is not None, "set by decide"
        since = now - self._changed_at[role]
        if need > current:
            if since >= cfg.up_cooldown_s:
                reasons.append(f"{role}: up {current} -> {need}")
                return need
            return current
        if current > bounds.max_nodes:
            return bounds.max_nodes
        window_need = bounds.clamp(max(n for _, n in history))
        if window_need < current and since >= cfg.down_cooldown_s:
            target = max(window_need, current - cfg.max_down_step)
            reasons.append(f"{role}: down {current} -> {target}")
            return target
        return max(current, bounds.min_nodes)

    def _cap(self, targets: dict[str, int], current: dict[str, int],
             reasons: list[str]) -> dict[str, int]:
        cap = self.config.max_nodes
        if cap is None or targets[PREFILL] + targets[DECODE] <= cap:
            return targets
        # nodes running and still wanted stay: taking them from one role to start them in
        # the other loses both a start-up and the role's capacity (flapping under the cap)
        kept = {role: min(targets[role], current[role]) for role in targets}
        if sum(kept.values()) > cap:
            floors = {role: self.config.bounds(role).min_nodes for role in targets}
            kept = _share(floors, kept, cap)
        capped = _share(kept, targets, cap)
        reasons.append(f"capped at {cap} nodes")
        return capped


def _share(base: dict[str, int], asked: dict[str, int], cap: int) -> dict[str, int]:
    """`base` plus the room left under `cap`, shared in proportion to what each role asks
    above its base."""
    room = cap - sum(base.values())
    extra = {role: asked[role] - base[role] for role in base}
    total = sum(extra.values())
    if total <= 0 or room <= 0:
        return dict(base)
    shared = {role: base[role] + room * extra[role] // total for role in base}
    for role in sorted(base, key=lambda r: -extra[r]):  # the rounding's leftover
        if sum(shared.values()) < cap and shared[role] < asked[role]:
            shared[role] += 1
    return shared


def _trend(points: deque[tuple[float, float]], now: float) -> tuple[float, float]:
    """The least-squares line through (time, rate) points: its slope and its value at `now`
    ((0, 0) with fewer than 3 points)."""
    if len(points) < 3:
        return 0.0, 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_r = sum(r for _, r in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var <= 0:
        return 0.0, mean_r
    slope = sum((t - mean_t) * (r - mean_r) for t, r in points) / var
    return slope, mean_r + slope * (now - mean_t)
