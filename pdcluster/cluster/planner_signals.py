"""The live planner's signals, read where they already are: the router's Prometheus metrics
(its `/metrics`: arrivals, prompt and cached tokens, output tokens, TTFT and inter-token
latency histograms) and each node's load report (queued prefill tokens, running requests, its
measured prefill rate), which the launcher reads through the node actors.

`RouterWindow.take(text)` turns two consecutive scrapes into one window's figures: counter
deltas and, from histogram bucket deltas, a p90 (the upper bound of the bucket the 90th
percentile falls in: conservative). The mean inter-token latency comes from the streamed
requests' histogram, or, with none streamed, from the requests' decode time (e2e latency less
TTFT) over the tokens after the first. `signals(...)` builds the planner's `Signals` and feeds
the capacity model's calibration: the prefill nodes' measured rates, and the decode step time
(the window's mean inter-token latency, one token per step) against the decode nodes' mean
batch and the context it holds.

API: `RouterWindow`, `WindowStats`, `NodeLoad`, `signals`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from pdcluster.router.planning.capacity import CapacityModel
from pdcluster.router.planning.planner import Signals

_GENERATION_ENDPOINTS = ("chat", "completions")


@dataclass(frozen=True, slots=True)
class WindowStats:
    requests: float  # generation requests that arrived (any status: shed ones are demand too)
    completed: float  # of those, answered 200
    prompt_tokens: float
    cached_tokens: float
    output_tokens: float
    ttft_p90_s: float | None
    itl_p90_s: float | None
    itl_mean_s: float | None


@dataclass(frozen=True, slots=True)
class NodeLoad:
    node_id: str
    role: str
    queued_prefill_tokens: int
    num_running: int
    prefill_tokens_per_s: float | None  # measured; None before the node has measured it


class RouterWindow:
    """Counter and histogram deltas between consecutive scrapes of the router's metrics."""

    def __init__(self) -> None:
        self._last: dict[str, float] | None = None
        self._buckets: dict[str, dict[float, float]] = {}

    def take(self, text: str) -> WindowStats | None:
        """This scrape against the last; None on the first (no window yet)."""
        now, buckets = _read(text)
        last, last_buckets = self._last, self._buckets
        self._last, self._buckets = now, buckets
        if last is None:
            return None

        def delta(name: str) -> float:
            return max(0.0, now.get(name, 0.0) - last.get(name, 0.0))

        itl_count = delta("router_inter_token_latency_seconds_count")
        itl_mean = delta("router_inter_token_latency_seconds_sum") / itl_count \
            if itl_count else None
        # streamed or not, a request's decode time is its e2e latency less its TTFT
        decode_tokens = delta("router_output_tokens_total") - delta("completed")
        decode_s = (delta("router_e2e_latency_seconds_sum")
                    - delta("router_ttft_seconds_sum"))
        if itl_mean is None and decode_tokens > 0 and decode_s > 0:
            itl_mean = decode_s / decode_tokens
        return WindowStats(
            delta("requests"), delta("completed"), delta("router_prompt_tokens_total"),
            delta("router_prefix_hit_tokens_total"), delta("router_output_tokens_total"),
            _p90(buckets.get("router_ttft_seconds", {}),
                 last_buckets.get("router_ttft_seconds", {})),
            _p90(buckets.get("router_inter_token_latency_seconds", {}),
                 last_buckets.get("router_inter_token_latency_seconds", {})),
            itl_mean)


def _read(text: str) -> tuple[dict[str, float], dict[str, dict[float, float]]]:
    values: dict[str, float] = {"requests": 0.0, "completed": 0.0}
    buckets: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "router_requests_total":
                if sample.labels.get("endpoint") in _GENERATION_ENDPOINTS:
                    values["requests"] += sample.value
                    if sample.labels.get("status") == "200":
                        values["completed"] += sample.value
            elif sample.name.endswith("_bucket"):
                edge = float(sample.labels["le"])
                buckets.setdefault(sample.name[:-len("_bucket")], {})[edge] = sample.value
            else:
                values[sample.name] = sample.value
    return values, buckets


def _p90(now: dict[float, float], last: dict[float, float]) -> float | None:
    """The upper edge of the bucket holding the window's 90th percentile (None: empty)."""
    edges = sorted(now)
    counts = [now[e] - last.get(e, 0.0) for e in edges]  # cumulative
    if not counts or counts[-1] <= 0:
        return None
    for edge, count in zip(edges, counts, strict=True):
        if count >= 0.9 * counts[-1]:
            return edge if math.isfinite(edge) else edges[-2] if len(edges) > 1 else None
    return None


def signals(window: WindowStats, window_s: float, loads: list[NodeLoad], num_prefill: int,
            num_decode: int, model: CapacityModel, output_avg: float) -> Signals:
    """The planner's signals for one window; calibrates `model` from the same figures."""
    requests = max(window.requests, 1.0)
    prefill = [n for n in loads if n.role == "prefill"] or loads  # no prefill nodes: D does
    decode = [n for n in loads if n.role != "prefill"]
    for node in prefill:
        if node.prefill_tokens_per_s:
            model.observe_prefill(node.prefill_tokens_per_s, 1.0)
    uncached = max(0.0, window.prompt_tokens - window.cached_tokens) / requests
    prompt = window.prompt_tokens / requests
    context = prompt + output_avg / 2
    # the window's tokens came from batches of at least one sequence, whatever the load
    # report caught at this instant
    running = max(1.0, sum(n.num_running for n in decode) / max(len(decode), 1))
    if window.itl_mean_s:
        model.observe_step(round(running), running * context, window.itl_mean_s)
    return Signals(window_s, round(window.requests), uncached, output_avg, context,
                   num_prefill, num_decode, float(sum(n.queued_prefill_tokens for n in prefill)),
                   window.ttft_p90_s, window.itl_p90_s)
