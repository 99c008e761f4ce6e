"""Prometheus metrics of one node, on a registry of its own (several nodes share a process in
tests), and the HTTP endpoint that serves them.

The engine and the KV connector know nothing of Prometheus: they keep plain counters
(`LLMEngine.counters()`, `WorkerStats`) and queues of durations (`LLMEngine.take_step_times`,
`ConnectorWorker.take_latencies`). `NodeMetrics.observe` runs on the node's engine thread after
every step (the only thread that may read the engine): it keeps a snapshot of the counters and
moves the durations into histograms. A scrape reads the snapshot, never the engine.

Every series carries the label `node` (the node id) and `role`:

    pdcluster_node_requests_waiting / _running          gauges (running: holding blocks)
    pdcluster_node_queued_prefill_tokens                 gauge
    pdcluster_node_kv_blocks{state=free|used|cached}     gauge (cached: in the prefix cache,
                                                         used or not); _kv_blocks_capacity
    pdcluster_node_prefix_queried_tokens_total           prompt tokens this node computed,
    pdcluster_node_prefix_hit_tokens_total               and those its prefix cache held
    pdcluster_node_preemptions_total
    pdcluster_node_requests_total{outcome=admitted|refused}
    pdcluster_node_kv_blocks_total{direction=sent|received|pulled|served}
    pdcluster_node_kv_bytes_total{direction=...}
    pdcluster_node_kv_transfers_total{direction, outcome=ok|failed}
    pdcluster_node_kv_transfer_timeouts_total
    pdcluster_node_kv_transfer_seconds{kind=send|recv|pull}   histogram
    pdcluster_node_step_seconds                                histogram

"sent"/"received" are prefill -> decode transfers (P's and D's side); "pulled"/"served" are
global prefix reuse (the requester's and the holder's side).

Security (docs/security.md): the endpoint serves counts and durations only — no prompts, no
token ids, no addresses, no credentials — and binds the node's own host, never 0.0.0.0 unless
the node's host is. It has no authentication, like the router's /metrics and Ray's metrics
port: on a cluster a NetworkPolicy admits only Prometheus (`networkPolicy.metricsFrom`).

API: `NodeMetrics`, `MetricsServer`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from pdcluster.core.kv_connector import TransferTiming
from pdcluster.engine.api import NodeEngine
from pdcluster.engine.core.outputs import EngineCounters

logger = logging.getLogger(__name__)
_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                     5, 10, 30)
# (direction, WorkerStats fields: blocks, bytes, ok transfers, failed transfers)
_DIRECTIONS = (("sent", "blocks_sent", "bytes_sent", "sends_ok", "sends_failed"),
               ("received", "blocks_received", "bytes_received", "recvs_ok", "recvs_failed"),
               ("pulled", "blocks_pulled", "bytes_pulled", "pulls_ok", "pulls_failed"),
               ("served", "blocks_served", "bytes_served", "pull_requests_served",
                "pull_serves_failed"))
_WORKER_FIELDS = tuple({f for row in _DIRECTIONS for f in row[1:]} | {"timeouts"})


@dataclass(slots=True)
class _Snapshot:
    engine: EngineCounters | None = None
    worker: dict[str, int] = field(default_factory=dict)
    num_admitted: int = 0
    num_refused: int = 0


class NodeMetrics:
    def __init__(self, node_id: str, role: str) -> None:
        self.node_id, self.role = node_id, role
        self.registry = r = CollectorRegistry()
        self._snapshot = _Snapshot()
        r.register(_SnapshotCollector(self))
        self.step_seconds = Histogram("pdcluster_node_step_seconds", "engine step duration",
                                      ["node", "role"], registry=r, buckets=_STEP_BUCKETS)
        self.transfer_seconds = Histogram(
            "pdcluster_node_kv_transfer_seconds", "KV transfer latency: send (P's write), recv "
            "(D's request to done), pull (global prefix reuse, request to done)",
            ["node", "role", "kind"], registry=r, buckets=_TRANSFER_BUCKETS)

    @property
    def snapshot(self) -> _Snapshot:
        return self._snapshot

    def observe(self, engine: NodeEngine, num_admitted: int = 0, num_refused: int = 0,
                transfers: Sequence[TransferTiming] = ()) -> None:
        """Take the engine's figures (on the thread that steps it); `transfers` are those
        the caller took from it (`engine.take_transfer_latencies`)."""
        self.update(engine.counters(), engine.transfer_counters(), num_admitted, num_refused)
        labels = (self.node_id, self.role)
        for seconds in engine.take_step_times():
            self.step_seconds.labels(*labels).observe(seconds)
        for timing in transfers:
            self.transfer_seconds.labels(*labels, timing.kind).observe(timing.seconds)

    def update(self, counters: EngineCounters, worker_counters: dict[str, int],
               num_admitted: int = 0, num_refused: int = 0) -> None:
        """Replace the snapshot the gauges and counters are read from."""
        # one assignment: a scrape sees the old snapshot or the new one, never half of each
        self._snapshot = _Snapshot(counters, dict(worker_counters), num_admitted, num_refused)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """The gauges and counters of the latest snapshot, built at scrape time."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        snap, labels = m.snapshot, [m.node_id, m.role]
        yield from _engine_families(snap.engine, labels)
        yield _counter("requests", "requests admitted or refused by the node",
                       [(["admitted"], snap.num_admitted), (["refused"], snap.num_refused)],
                       labels, "outcome")
        yield from _worker_families(snap.worker, labels)


def _gauge(name: str, doc: str, value: float, labels: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"pdcluster_node_{name}", doc, labels=["node", "role"])
    family.add_metric(labels, value)
    return family


def _counter(name: str, doc: str, rows: Sequence[tuple[list[str], float]], labels: list[str],
             *extra: str) -> CounterMetricFamily:
    family = CounterMetricFamily(f"pdcluster_node_{name}", doc,
                                 labels=["node", "role", *extra])
    for values, value in rows:
        family.add_metric(labels + values, value)
    return family


def _engine_families(c: EngineCounters | None, labels: list[str]) -> Iterator[Metric]:
    if c is None:
        return
    load = c.load
    yield _gauge("requests_waiting", "requests waiting to start", load.num_waiting, labels)
    yield _gauge("requests_running", "requests holding KV blocks (running or waiting for "
                 "remote KV)", load.num_running, labels)
    yield _gauge("queued_prefill_tokens", "prompt tokens still to compute",
                 load.num_queued_tokens, labels)
    yield _gauge("kv_blocks_capacity", "KV blocks in the pool", load.num_blocks, labels)
    blocks = GaugeMetricFamily("pdcluster_node_kv_blocks", "KV blocks by state (cached: in "
                               "the prefix cache, in use or not)",
                               labels=["node", "role", "state"])
    for state, value in (("free", load.num_free_blocks), ("used", c.num_used_blocks),
                         ("cached", c.num_cached_blocks)):
        blocks.add_metric([*labels, state], value)
    yield blocks
    yield _counter("prefix_queried_tokens", "prompt tokens of requests this node computed, "
                   "looked up in its prefix cache", [([], c.num_prefix_queried_tokens)], labels)
    yield _counter("prefix_hit_tokens", "prompt tokens this node's prefix cache held",
                   [([], c.num_prefix_hit_tokens)], labels)
    yield _counter("preemptions", "requests preempted for KV blocks",
                   [([], c.num_preemptions)], labels)
    yield _counter("spec_draft_tokens", "speculative decoding: draft tokens verified",
                   [([], c.num_spec_draft_tokens)], labels)
    yield _counter("spec_accepted_tokens", "speculative decoding: draft tokens accepted",
                   [([], c.num_spec_accepted_tokens)], labels)


def _worker_families(w: dict[str, int], labels: list[str]) -> Iterator[Metric]:
    if not w:
        return
    w = {name: w.get(name, 0) for name in _WORKER_FIELDS}
    yield _counter("kv_blocks", "KV blocks moved, by direction",
                   [([d], w[blocks]) for d, blocks, *_ in _DIRECTIONS], labels, "direction")
    yield _counter("kv_bytes", "KV bytes moved, by direction",
                   [([d], w[nbytes]) for d, _, nbytes, *_ in _DIRECTIONS], labels, "direction")
    rows = [([d, "ok"], w[ok]) for d, _, _, ok, _ in _DIRECTIONS]
    rows += [([d, "failed"], w[failed]) for d, _, _, _, failed in _DIRECTIONS]
    yield _counter("kv_transfers", "KV transfers finished, by direction and outcome", rows,
                   labels, "direction", "outcome")
    yield _counter("kv_transfer_timeouts", "KV transfers (either kind) that timed out",
                   [([], w["timeouts"])], labels)


class MetricsServer:
    """Serves a registry at http://host:port/metrics (port 0: a free one) on a daemon
    thread. A port in use (two nodes on one pod) falls back to a free one, with a warning:
    metrics are not worth failing a node for, and the address it registers is the real one."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if not port:
                raise
            logger.warning("metrics port %s:%d unavailable (%s): serving on a free port",
                           host, port, exc)
            self._server, self._thread = start_http_server(0, addr=host, registry=registry)
        self.host, self.port = host, self._server.server_port
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def stop(self) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(5)
