"""How many prefill and how many decode nodes a load needs: the planner's capacity model,
calibrated online from what the nodes measure. Pure: no I/O, no clock.

Prefill. A prefill node serves prompts one after another at `prefill_tokens_per_s` (plus
`prefill_fixed_s` per request); the router sends each request to the node with the shortest
queue, which behaves like one queue in front of n servers. With arrivals at rate λ and a mean
service time S = fixed + L / rate (L: uncached prompt tokens per request), the load is a = λS
Erlangs and, in the M/M/n model, the chance that a request waits longer than t is

    P(W > t) = C(n, a) * exp(-(n - a) * t / S)          (Erlang C; 0 when n <= a is false)

The planner asks for the fewest nodes with P(W > SLO_ttft - S - backlog) <= `wait_miss`,
where backlog is the time the prefill queues already hold (queued tokens over the n nodes'
rate): the queue the next interval inherits.

Decode. A decode node runs one batch; a step takes

    step_s(B, ctx) = step_base_s + step_per_seq_s * B + step_per_ctx_token_s * ctx

(B sequences holding ctx tokens of KV in all), and each step gives every sequence one token,
so the inter-token latency is the step time. The largest batch that keeps the ITL under the
SLO is B_max = (SLO_itl - base) / (per_seq + per_ctx * mean context), capped by
`max_batch` and by the node's KV memory (`kv_tokens_per_node` / mean context). By Little's
law a load keeps K = λ * output_tokens * step_s sequences decoding; the planner covers K plus
`decode_z` standard deviations of a Poisson count (sqrt K): n = ceil((K + z sqrt K) / B_max).

Calibration. `observe_prefill(tokens, busy_s)` (prompt tokens a node computed and the time it
was busy doing so) and `observe_step(batch, ctx, step_s)` feed exponentially forgetting
estimates: the prefill rate as a ratio of decayed sums, the step-time coefficients by
recursive least squares on (1, B, ctx) with forgetting, kept non-negative. Until observations
arrive the priors (the constructor's figures) stand.

API: `CapacityModel`, `Workload`, `erlang_c`, `wait_exceeds`, `Rls` (least squares with
forgetting, shared with router.planning.admission).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Workload:
    """The load to plan for: arrivals per second, and per request the mean uncached prompt
    tokens (what a prefill node computes), output tokens and KV context a decoding sequence
    holds; plus what the prefill queues hold now."""

    rate_per_s: float
    prefill_tokens: float
    output_tokens: float
    context_tokens: float
    queued_prefill_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rate_per_s", "prefill_tokens", "output_tokens", "context_tokens",
                     "queued_prefill_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def erlang_c(servers: int, load: float) -> float:
    """The chance an arrival waits in an M/M/`servers` queue offered `load` Erlangs (1 when
    the queue is unstable)."""
    if servers < 1 or load >= servers:
        return 1.0
    if load <= 0:
        return 0.0
    blocking = 1.0  # Erlang B by its recursion: stable for any number of servers
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return servers * blocking / (servers - load * (1.0 - blocking))


def wait_exceeds(servers: int, load: float, service_s: float, wait_s: float) -> float:
    """P(W > wait_s) in an M/M/`servers` queue with mean service time `service_s`."""
    if wait_s < 0:
        return 1.0
    waits = erlang_c(servers, load)
    if waits >= 1.0 or service_s <= 0:
        return waits
    return waits * math.exp(-(servers - load) * wait_s / service_s)


class Rls:
    """Recursive least squares with exponential forgetting on a few features. The covariance's
    trace is held at or below its starting value: forgetting alone lets it grow without bound
    in directions the data does not excite (a live load that repeats itself), and one unusual
    sample would then swing the fit ("wind-up")."""

    def __init__(self, prior: list[float], forget: float, prior_weight: float) -> None:
        n = len(prior)
        self.coef = list(prior)
        # a diagonal covariance: how far the prior may move with the first observations
        self._p = [[(1.0 / prior_weight if i == j else 0.0) for j in range(n)]
                   for i in range(n)]
        self._max_trace = n / prior_weight
        self._forget = forget

    def update(self, x: list[float], y: float) -> None:
        n, p = len(x), self._p
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = self._forget + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        error = y - sum(c * v for c, v in zip(self.coef, x, strict=True))
        self.coef = [c + g * error for c, g in zip(self.coef, gain, strict=True)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / self._forget for j in range(n)]
                   for i in range(n)]
        trace = sum(self._p[i][i] for i in range(n))
        if trace > self._max_trace:
            scale = self._max_trace / trace
            self._p = [[v * scale for v in row] for row in self._p]


class CapacityModel:
    """Prefill and decode capacity per node, calibrated online (module docstring)."""

    def __init__(self, prefill_tokens_per_s: float = 10_000.0, prefill_fixed_s: float = 0.005,
                 step_base_s: float = 0.012, step_per_seq_s: float = 0.0002,
                 step_per_ctx_token_s: float = 4e-8, max_batch: int = 256,
                 kv_tokens_per_node: float = 450_000.0, forget: float = 0.98) -> None:
        if not (prefill_tokens_per_s > 0 and step_base_s >= 0 and max_batch >= 1
                and kv_tokens_per_node > 0 and 0 < forget <= 1):
            raise ValueError("capacity priors must be positive and forget in (0, 1]")
        self.prefill_fixed_s = prefill_fixed_s
        self.max_batch = max_batch
        self.kv_tokens_per_node = kv_tokens_per_node
        self._forget = forget
        # the rate as decayed tokens over decayed seconds, seeded with 1 s of the prior
        self._tokens, self._busy_s = prefill_tokens_per_s, 1.0
        # scales of the features keep the least-squares problem well conditioned
        self._step = Rls([step_base_s, step_per_seq_s * 100, step_per_ctx_token_s * 1e6],
                          forget, prior_weight=1.0)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._tokens / self._busy_s

    @property
    def step_coefficients(self) -> tuple[float, float, float]:
        """(base s, s per sequence, s per context token), never negative."""
        base, per_100_seqs, per_m_tokens = (max(0.0, c) for c in self._step.coef)
        return base, per_100_seqs / 100, per_m_tokens / 1e6

    def observe_prefill(self, tokens: float, busy_s: float) -> None:
        """A node computed `tokens` prompt tokens in `busy_s` seconds of work."""
        if tokens > 0 and busy_s > 0:
            self._tokens = self._tokens * self._forget + tokens
            self._busy_s = self._busy_s * self._forget + busy_s

    def observe_step(self, batch: int, context_tokens: float, step_s: float) -> None:
        """A decode step of `batch` sequences holding `context_tokens` took `step_s`."""
        if batch >= 1 and step_s > 0:
            self._step.update([1.0, batch / 100, context_tokens / 1e6], step_s)

    def step_s(self, batch: float, context_tokens: float) -> float:
        base, per_seq, per_token = self.step_coefficients
        return base + per_seq * batch + per_token * context_tokens

    def prefill_service_s(self, prefill_tokens: float) -> float:
        return self.prefill_fixed_s + prefill_tokens / self.prefill_tokens_per_s

    def prefill_nodes(self, load: Workload, slo_ttft_s: float, wait_miss: float,
                      most: int) -> int:
        """The fewest prefill nodes (up to `most`) whose queue keeps P(TTFT > SLO) for a mean
        request at or under `wait_miss`; `most` when none does."""
        service_s = self.prefill_service_s(load.prefill_tokens)
        offered = load.rate_per_s * service_s
        rate = self.prefill_tokens_per_s
        for n in range(1, most + 1):
            backlog_s = load.queued_prefill_tokens / (n * rate)
            if wait_exceeds(n, offered, service_s, slo_ttft_s - service_s - backlog_s) \
                    <= wait_miss:
                return n
        return most

    def max_batch_for(self, slo_itl_s: float, context_tokens: float) -> int:
        """The largest batch whose step stays within `slo_itl_s` (at least 1)."""
        base, per_seq, per_token = self.step_coefficients
        per_batch = per_seq + per_token * context_tokens
        fits = (slo_itl_s - base) / per_batch if per_batch > 0 else float(self.max_batch)
        by_memory = self.kv_tokens_per_node / max(context_tokens, 1.0)
        return max(1, int(min(fits, by_memory, self.max_batch)))

    def decode_nodes(self, load: Workload, slo_itl_s: float, z: float, most: int) -> int:
        """The fewest decode nodes (up to `most`) whose batches keep the step time within
        the ITL SLO for the sequences the load keeps decoding."""
        batch = self.max_batch_for(slo_itl_s, load.context_tokens)
        step_s = self.step_s(batch, batch * load.context_tokens)
        decoding = load.rate_per_s * load.output_tokens * step_s
        needed = (decoding + z * math.sqrt(decoding)) / batch
        return max(1, min(most, math.ceil(needed)))
