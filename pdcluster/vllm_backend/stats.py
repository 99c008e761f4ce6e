"""What vLLM's engine reports about itself, kept for the node: a vLLM stat logger.

vLLM calls its stat loggers with `SchedulerStats` (running and waiting requests, KV cache
usage, prefix-cache queries and hits, the connector's stats) and `IterationStats` (tokens,
preemptions) after every engine step, on the thread of its output handler. `EngineStats`
keeps the latest gauges and running totals under a lock; the node's engine thread reads them
for load reports, metrics and leak checks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY
from vllm.v1.metrics.loggers import PrometheusStatLogger, StatLoggerBase

from pdcluster.core.kv_connector import TransferTiming


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_steps: int = 0
    num_reports: int = 0  # of scheduler stats (KV usage, requests): aborts.py waits on them
    num_preemptions: int = 0
    num_prefix_queried_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    transfers_in_flight: int = 0
    transfer_counters: dict[str, int] = field(default_factory=dict)
    transfer_latencies: list[TransferTiming] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, scheduler: Any, iteration: Any) -> None:
        with self.lock:
            self.num_steps += 1
            if iteration is not None:
                self.num_preemptions += getattr(iteration, "num_preempted_reqs", 0)
            if scheduler is None:
                return
            self.num_reports += 1
            self.num_running = scheduler.num_running_reqs
            self.num_waiting = scheduler.num_waiting_reqs + scheduler.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler.kv_cache_usage
            prefix = scheduler.prefix_cache_stats
            self.num_prefix_queried_tokens += prefix.queries
            self.num_prefix_hit_tokens += prefix.hits
            self._record_connector(scheduler.kv_connector_stats or {})

    def _record_connector(self, data: dict[str, Any]) -> None:
        if "in_flight" in data:
            self.transfers_in_flight = int(data["in_flight"])
        if data.get("counters"):
            self.transfer_counters = dict(data["counters"])
        # from the worker processes, as plain sequences: (kind, seconds, request id, end ns)
        self.transfer_latencies.extend(
            TransferTiming(str(t[0]), float(t[1]), *t[2:4]) for t in data.get("latencies", ()))

    def take_latencies(self) -> list[TransferTiming]:
        with self.lock:
            taken, self.transfer_latencies = self.transfer_latencies, []
        return taken


def logger_factory(stats: EngineStats):
    """A vLLM stat-logger factory whose loggers record into `stats`."""

    class NodeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.stats = stats

        def record(self, scheduler_stats: Any, iteration_stats: Any,
                   mm_cache_stats: Any = None, engine_idx: int = 0) -> None:
            self.stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            return

    return NodeStatLogger


_PROMETHEUS_LOCK = threading.Lock()


class SerializedPrometheusStatLogger(PrometheusStatLogger):
    """vLLM's Prometheus logger, built under a process-wide lock: it unregisters every
    `vllm:` metric from the global registry and then registers its own, so two engines built
    at once in one process (a test's pair of nodes) could each register the same name and the
    second would fail with `DuplicateTimeseries`. Once the engine is up it registers one more
    metric, `vllm:cache_config_info`, without unregistering first: two engines built in turn and
    then both up would register it twice, so it too goes under the lock, replacing an earlier
    engine's. Passed as a custom logger, it replaces vLLM's default one."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        with _PROMETHEUS_LOCK:
            super().__init__(vllm_config, engine_indexes)

    def log_metrics_info(self, type: str, config_obj: Any) -> None:
        with _PROMETHEUS_LOCK:
            for collector in list(REGISTRY._collector_to_names):
                if getattr(collector, "_name", None) == f"vllm:{type}_info":
                    REGISTRY.unregister(collector)
            super().log_metrics_info(type, config_obj)
