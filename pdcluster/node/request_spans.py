"""A node's spans for the requests it serves (core.tracing): one `node.request` span per
request, a child of the router's span named by the request's `traceparent`, with two
children split at the first token it sends:

- `node.prefill` (a prefill node's whole part, or a node prefilling locally): admission,
  queue and prefill, until the first token;
- `kv.wait` on a decode node whose prompt a prefill node computes: until its KV has arrived
  and the first token is sampled (the prefill node's work and the transfer, seen from here);
- `node.decode`: from the first token to the last.

Timestamps are taken on the server thread as the events happen and the spans are ended
once the request is forgotten (finished, aborted or failed), so nothing here touches the
engine. Each KV transfer the node's connector finishes is a span of its own under the
router's: `kv.send` (a prefill node writing a request's KV into its decode node, which
often ends after the node's part of the request did), `kv.recv` (a decode node, from asking
for the KV to having it) and `kv.pull` (a prefix pulled from a peer), timed by the connector
(`TransferTiming`); the trace is found by request id among the node's recent requests.

API: `RequestSpans` (`begin`, `delta`, `end`, `transfers`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from opentelemetry import trace

from pdcluster.core import tracing
from pdcluster.core.kv_connector import TransferTiming
from pdcluster.core.node_wire import GenerateRequest

# requests whose trace a transfer finishing after them can still join (oldest forgotten)
_RECENT_TRACES = 4096


@dataclass(slots=True)
class _Times:
    traceparent: str | None
    kind: str  # "remote_prefill" (KV comes from a prefill node), "remote_decode", "local"
    prompt_tokens: int
    started_ns: int
    first_ns: int = 0
    tokens: int = 0


class RequestSpans:
    def __init__(self, node_id: str, role: str) -> None:
        self.node_id, self.role = node_id, role
        self._open: dict[str, _Times] = {}
        self._recent: OrderedDict[str, str] = OrderedDict()  # request id -> traceparent

    def begin(self, msg: GenerateRequest) -> None:
        kind = msg.transfer.kind if msg.transfer is not None else "local"
        self._open[msg.request_id] = _Times(msg.traceparent, kind, len(msg.prompt_token_ids),
                                            time.time_ns())
        if msg.traceparent:
            self._recent[msg.request_id] = msg.traceparent
            while len(self._recent) > _RECENT_TRACES:
                self._recent.popitem(last=False)

    def delta(self, request_id: str, num_tokens: int) -> None:
        times = self._open.get(request_id)
        if times is not None:
            if not times.first_ns and num_tokens:
                times.first_ns = time.time_ns()
            times.tokens += num_tokens

    def end(self, request_id: str) -> None:
        times = self._open.pop(request_id, None)
        if times is None:
            return
        ended = time.time_ns()
        tracer = tracing.tracer()
        root = tracer.start_span(
            "node.request", context=tracing.parent_context(times.traceparent),
            kind=trace.SpanKind.SERVER, start_time=times.started_ns,
            attributes={"pdcluster.component": "node", "pdcluster.node": self.node_id,
                        "pdcluster.role": self.role, "pdcluster.transfer": times.kind,
                        "pdcluster.prompt_tokens": times.prompt_tokens,
                        "pdcluster.output_tokens": times.tokens})
        inside = trace.set_span_in_context(root)
        first = times.first_ns or ended
        name = "kv.wait" if times.kind == "remote_prefill" else "node.prefill"
        tracer.start_span(name, context=inside, start_time=times.started_ns).end(first)
        if times.first_ns:
            tracer.start_span("node.decode", context=inside, start_time=first).end(ended)
        root.end(ended)

    def transfers(self, timings: Iterable[TransferTiming]) -> None:
        """A `kv.<kind>` span for each finished transfer of a recent traced request."""
        for timing in timings:
            traceparent = self._recent.get(timing.request_id)
            if traceparent is None or not timing.ended_ns:
                continue
            started = timing.ended_ns - int(timing.seconds * 1e9)
            tracing.tracer().start_span(
                f"kv.{timing.kind}", context=tracing.parent_context(traceparent),
                start_time=started,
                attributes={"pdcluster.component": "node", "pdcluster.node": self.node_id,
                            "pdcluster.role": self.role}).end(timing.ended_ns)
