"""Admission by predicted time to first token: the router's decision to take a request, hold it
or shed it (429) before sending it anywhere. Pure: the caller gives it the chosen node's queue
and the request's uncached prompt, and the TTFTs it measured.

Prediction, per prefilling node n (the prefill node, or the decode node prefilling locally):

    work(r)      = queued_prefill_tokens(n) + uncached_tokens(r)   (the node's queue is FIFO)
    predicted(r) = base_s(n) + seconds_per_token(n) * work(r)

`base_s` and `seconds_per_token` start from priors (the node's own measured prefill rate when
its load report carries one) and are fitted online, per node, by recursive least squares with
forgetting on (1, work) against the TTFT the router measures when the first token arrives
(`observe`, which returns the prediction's error: the router exports it as a metric).

Decision: a request of priority class c is admitted when predicted <= `slo_ttft_s` x
`shed_at[c]`. The lower a class's share, the earlier it is shed as queues grow: with the
defaults low requests go once the queue alone would take half the SLO, normal ones at 0.8
of it, high ones only when they would miss it anyway, so a rising load sheds low first and
keeps room for the others. A node that has had no request admitted for `probe_after_s`
gets the next one whatever its prediction (a probe): the fit learns only from admitted
requests, so without probes a prediction that went high (a burst, a busy machine) would shed
everything after the queue drained, for good. A shed request gets 429 with Retry-After (the
seconds until the queue drains to its threshold at the node's rate, at least 1), or, in
mode "queue", waits up to `max_queue_s` for the prediction to come under its threshold,
higher classes first.

Priority: the header `header` (high / normal / low) or the API key's tenant setting
(`tenant_priorities`); with API keys the header may lower a tenant's class, never raise it.

API: `AdmissionConfig`, `TtftPredictor`, `Verdict`, `admit`, `PRIORITIES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdcluster.router.planning.capacity import Rls

PRIORITIES = ("high", "normal", "low")  # most important first
MODES = ("reject", "queue")


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    slo_ttft_s: float = 2.0
    mode: str = "reject"  # "queue": hold a request up to max_queue_s instead of a 429
    max_queue_s: float = 10.0
    # class -> the share of the SLO its predicted TTFT may reach before it is shed
    shed_at: tuple[tuple[str, float], ...] = (("high", 1.0), ("normal", 0.8), ("low", 0.5))
    default_priority: str = "normal"
    header: str = "X-Priority"
    tenant_priorities: tuple[tuple[str, str], ...] = ()  # (tenant name, class)
    # a node no request was admitted to for this long gets the next one anyway: its fit
    # learns only from admitted requests, and would otherwise never see the queue drain
    probe_after_s: float = 5.0
    prior_base_s: float = 0.05  # fixed part of a TTFT before any measurement
    prior_tokens_per_s: float = 10_000.0  # until the node reports its prefill rate
    forget: float = 0.95

    def __post_init__(self) -> None:
        if not self.slo_ttft_s > 0 or self.max_queue_s < 0 or self.probe_after_s <= 0:
            raise ValueError("slo_ttft_s and probe_after_s must be > 0 and max_queue_s >= 0")
        if self.mode not in MODES:
            raise ValueError(f"admission mode must be one of {MODES}, got {self.mode!r}")
        if {name for name, _ in self.shed_at} != set(PRIORITIES):
            raise ValueError(f"shed_at must name each class once: {PRIORITIES}")
        if any(not share > 0 for _, share in self.shed_at):
            raise ValueError("every class's shed_at share must be > 0")
        classes = [self.default_priority, *(c for _, c in self.tenant_priorities)]
        unknown = [c for c in classes if c not in PRIORITIES]
        if unknown:
            raise ValueError(f"unknown priority {unknown[0]!r}; choose from {PRIORITIES}")
        if not (self.prior_base_s >= 0 and self.prior_tokens_per_s > 0
                and 0 < self.forget <= 1):
            raise ValueError("priors must be positive and forget in (0, 1]")

    def threshold_s(self, priority: str) -> float:
        return self.slo_ttft_s * dict(self.shed_at)[priority]

    def priority(self, header_value: str | None, tenant: str | None) -> str:
        """The request's class: its tenant's (or the default), lowered by the header."""
        base = dict(self.tenant_priorities).get(tenant or "", self.default_priority)
        asked = (header_value or "").strip().lower()
        if asked not in PRIORITIES:
            return base
        if tenant is None:  # no API keys: the header decides
            return asked
        return max(base, asked, key=PRIORITIES.index)


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    predicted_s: float
    threshold_s: float
    retry_after_s: int  # 0 when admitted


class TtftPredictor:
    """TTFT from a node's queue and a request's uncached prompt, fitted online per node."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._fits: dict[str, Rls] = {}
        self._error_avg: float | None = None

    def _fit(self, node_id: str, tokens_per_s: float | None) -> Rls:
        fit = self._fits.get(node_id)
        if fit is None:
            rate = tokens_per_s or self.config.prior_tokens_per_s
            # work in thousands of tokens keeps the two coefficients of one scale
            fit = Rls([self.config.prior_base_s, 1000.0 / rate], self.config.forget,
                      prior_weight=2.0)
            self._fits[node_id] = fit
        return fit

    def predict(self, node_id: str, queued_tokens: float, uncached_tokens: float,
                tokens_per_s: float | None = None) -> float:
        base, per_k = self._fit(node_id, tokens_per_s).coef
        return max(0.0, base) + max(per_k, 1e-9) * (queued_tokens + uncached_tokens) / 1000

    def observe(self, node_id: str, queued_tokens: float, uncached_tokens: float,
                measured_s: float) -> float:
        """Fold in a measured TTFT; returns measured - predicted (before the update)."""
        error = measured_s - self.predict(node_id, queued_tokens, uncached_tokens)
        self._fit(node_id, None).update([1.0, (queued_tokens + uncached_tokens) / 1000],
                                        measured_s)
        relative = abs(error) / max(measured_s, 1e-3)
        self._error_avg = relative if self._error_avg is None \
            else 0.8 * self._error_avg + 0.2 * relative
        return error

    @property
    def mean_relative_error(self) -> float:
        """An exponential average of |error| / measured over recent observations."""
        return self._error_avg or 0.0



def admit(config: AdmissionConfig, predicted_s: float, priority: str) -> Verdict:
    """Admit or shed one request of `priority` whose predicted TTFT is `predicted_s`."""
    threshold = config.threshold_s(priority)
    if predicted_s <= threshold:
        return Verdict(True, predicted_s, threshold, 0)
    # the queue drains at the node's rate: the time until this class's threshold is reached
    retry = max(1, math.ceil(predicted_s - threshold))
    return Verdict(False, predicted_s, threshold, min(retry, 60))
