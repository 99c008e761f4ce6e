"""OpenTelemetry tracing shared by the router and the nodes: one trace per request, from the
router's HTTP span to the prefill node's and the decode node's, joined by a W3C `traceparent`
the router puts on every `GenerateRequest` (core.node_wire).

Spans are always made, so their ids exist and propagate; they leave the process only when
OTLP export is configured by OpenTelemetry's own variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; OTLP over HTTP/protobuf, batched). Without them nothing
is exported and no collector is needed. One provider per process (a test process holding a
router and nodes shares it); each span names its component in `pdcluster.component`.

API: `tracer()`, `tracer_provider()` (to add a span processor: tests, an embedding app),
`traceparent(span)`, `parent_context(traceparent)`, `flush()`.
"""

from __future__ import annotations

import os
import threading

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_lock = threading.Lock()
_provider: TracerProvider | None = None
_propagator = TraceContextTextMapPropagator()


def _get_provider() -> TracerProvider:
    global _provider
    with _lock:
        if _provider is None:
            provider = TracerProvider(resource=Resource.create(
                {"service.name": os.environ.get("OTEL_SERVICE_NAME", "pdcluster")}))
            if any(os.environ.get(name) for name in _ENDPOINT_VARS):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            _provider = provider
        return _provider


def tracer() -> trace.Tracer:
    return _get_provider().get_tracer("pdcluster")


def tracer_provider() -> TracerProvider:
    return _get_provider()


def traceparent(span: trace.Span | None = None) -> str | None:
    """The W3C traceparent of `span` (default: the current one); None without a valid one."""
    span = span or trace.get_current_span()
    if not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def parent_context(value: str | None) -> Context | None:
    """The context a `traceparent` names (None: start a new trace)."""
    if not value:
        return None
    context = _propagator.extract({"traceparent": value})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def flush(timeout_ms: int = 5000) -> bool:
    """Export what is batched now (benchmarks and tests; the batch also leaves by itself)."""
    return _get_provider().force_flush(timeout_ms)
