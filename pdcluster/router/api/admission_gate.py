"""The router's admission gate: each placed request's TTFT predicted from its prefilling
node's queue and its uncached prompt (router.planning.admission), then admitted, held (mode
"queue") or shed with 429 and Retry-After; the prediction is checked against the TTFT
measured at the first token, and its error exported. A node with no admission for
`probe_after_s` takes the next request anyway (a probe that re-calibrates its fit).

The queue a node has is what its last load report said plus the prompt tokens the router
sent it since (`NodeLink.pending_tokens`), as the routing policy sees it. In mode "queue" a
request that cannot be admitted now is placed again every `load_interval_s` until its
prediction comes under its class's threshold or `max_queue_s` runs out (then 429); while a
request of a higher class waits, lower classes do not pass it.

API: `AdmissionGate`, `Prediction`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdcluster.router.errors import ApiError
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.planning.admission import (
    PRIORITIES,
    AdmissionConfig,
    TtftPredictor,
    Verdict,
    admit,
)
from pdcluster.router.routing.dispatch import Dispatcher, Placement


@dataclass(frozen=True, slots=True)
class Prediction:
    """What one admitted request was predicted from, for checking it at its first token."""

    node_id: str
    queued_tokens: float
    uncached_tokens: float
    predicted_s: float


class AdmissionGate:
    def __init__(self, config: AdmissionConfig, dispatcher: Dispatcher,
                 metrics: RouterMetrics, poll_s: float) -> None:
        self.config, self.dispatcher, self.metrics = config, dispatcher, metrics
        self.predictor = TtftPredictor(config)
        self._poll_s = poll_s
        self._waiting = dict.fromkeys(PRIORITIES, 0)
        self._admitted_at: dict[str, float] = {}  # node -> when a request last went there

    def predict(self, placement: Placement, num_prompt: int) -> Prediction:
        decision = placement.decision
        node_id = decision.prefill_node or decision.decode_node
        link = self.dispatcher.nodes.get(node_id)
        queued, rate = 0.0, None
        if link is not None:
            queued = float(link.pending_tokens)
            if link.report is not None:
                queued += link.report.queued_prefill_tokens
                if link.report.kv_costs is not None:
                    rate = link.report.kv_costs.prefill_tokens_per_s
        held = decision.cached_tokens
        if decision.prefix_source is not None:
            held = max(held, decision.prefix_source_blocks * self.dispatcher.block_size)
        uncached = float(max(0, num_prompt - held))
        predicted = self.predictor.predict(node_id, queued, uncached, rate)
        return Prediction(node_id, queued, uncached, predicted)

    async def admit(self, place: Callable[[], Awaitable[Placement]], num_prompt: int,
                    priority: str) -> tuple[Placement, Prediction]:
        """Place the request and admit it, hold it, or raise a 429 `ApiError`."""
        deadline = time.monotonic() + (self.config.max_queue_s
                                       if self.config.mode == "queue" else 0.0)
        held = False
        try:
            while True:
                placement = await place()
                prediction = self.predict(placement, num_prompt)
                verdict = admit(self.config, prediction.predicted_s, priority)
                if (verdict.admitted and not self._outranked(priority)) \
                        or self._probe(prediction.node_id):
                    self._admitted_at[prediction.node_id] = time.monotonic()
                    return placement, prediction
                if time.monotonic() + self._poll_s > deadline:
                    raise self._shed(verdict, priority)
                if not held:
                    held = True
                    self._waiting[priority] += 1
                    self._count_waiting()
                await asyncio.sleep(self._poll_s)
        finally:
            if held:
                self._waiting[priority] -= 1
                self._count_waiting()

    def _probe(self, node_id: str) -> bool:
        """No request went to `node_id` for `probe_after_s`: this one does (its TTFT
        re-calibrates the node's fit)."""
        last = self._admitted_at.setdefault(node_id, time.monotonic())
        if time.monotonic() - last < self.config.probe_after_s:
            return False
        self.metrics.admission_probes.inc()
        return True

    def _outranked(self, priority: str) -> bool:
        """A request of a higher class is being held (mode "queue"): it goes first."""
        return any(self._waiting[p] for p in PRIORITIES[:PRIORITIES.index(priority)])

    def _count_waiting(self) -> None:
        self.metrics.admission_waiting.set(sum(self._waiting.values()))

    def _shed(self, verdict: Verdict, priority: str) -> ApiError:
        self.metrics.shed.labels(priority).inc()
        retry = max(verdict.retry_after_s, 1)
        return ApiError(429, f"the cluster cannot serve a '{priority}' request within its "
                        f"TTFT target now (predicted {verdict.predicted_s:.2f} s, limit "
                        f"{verdict.threshold_s:.2f} s); retry after {retry} s", None,
                        "overloaded", "rate_limit_error", retry_after_s=retry)

    def observe(self, prediction: Prediction, measured_s: float) -> None:
        """The first token arrived `measured_s` after dispatch: check and refit."""
        error = self.predictor.observe(prediction.node_id, prediction.queued_tokens,
                                       prediction.uncached_tokens, measured_s)
        self.metrics.ttft_prediction_error.observe(abs(error))
        self.metrics.ttft_prediction_relative_error.set(self.predictor.mean_relative_error)
