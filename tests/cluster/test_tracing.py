"""One trace per request across processes, on a real local Ray (1 prefill + 1 decode actor,
the metadata service, Mooncake over TCP) with the real router in this process: the router's
`router.request` span, the prefill node's and the decode node's `node.request` spans (each in
its own actor process, exported over OTLP/HTTP to a receiver this test runs) share one trace
id, the nodes' spans are children of the router's, the decode node's `kv.wait` precedes its
`node.decode`, the KV transfer is a span on each side (`kv.send` on the prefill node within
`kv.recv` on the decode node, both within `kv.wait`); and a client's own `traceparent` is
continued."""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.ray_cluster import RayCluster
from pdcluster.core import tracing
from tests.cluster.test_failures import Router
from tests.models import random_prompts

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)
MODEL = "llama-gqa"
BLOCK = 8


class Receiver:
    """An OTLP/HTTP trace receiver: every exported span as (trace id, span id, parent, name,
    attributes, start, end)."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        spans = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            spans.append({
                                "trace": span.trace_id.hex(), "span": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(), "name": span.name,
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                                "attributes": {a.key: a.value.string_value or
                                               a.value.int_value for a in span.attributes}})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"


@pytest.fixture(scope="module")
def traced_cluster(model_dirs):
    receiver = Receiver()
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                                            "OTEL_BSP_SCHEDULE_DELAY")}
    # the node actors' processes inherit these from the Ray this test starts
    os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = receiver.endpoint
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "200"
    config = ClusterConfig(model=model_dirs[MODEL], num_prefill=1, num_decode=1,
                           engine={"num_kv_blocks": 256, "block_size": BLOCK}, kv_timeout_s=5,
                           node_cpus=0.5)
    cluster = RayCluster(config).start()
    try:
        yield cluster, receiver
    finally:
        cluster.stop(drain_timeout_s=10)
        receiver.server.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def wait_for(receiver: Receiver, trace_id: str, count: int, timeout_s: float = 30.0,
             name: str = "node.request") -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [s for s in receiver.spans if s["trace"] == trace_id]
        if sum(s["name"] == name for s in found) >= count:
            return found
        assert time.monotonic() < deadline, f"node spans never arrived: {found}"
        time.sleep(0.1)


def test_one_trace_from_router_through_prefill_and_transfer_to_decode(traced_cluster,
                                                                       model_dirs):
    cluster, receiver = traced_cluster
    local = InMemorySpanExporter()  # the router's spans, in this process
    tracing.tracer_provider().add_span_processor(SimpleSpanProcessor(local))
    router = Router(cluster, model_dirs[MODEL], max_migrations=1)
    try:
        router.wait_healthy({"p0", "d0"})
        prompt = random_prompts(1, 48, 48, seed=5)[0]
        router.client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                         temperature=0)
        assert router.attempts[0][0].decision.prefill_node == "p0"  # disaggregated
        (root,) = [s for s in local.get_finished_spans() if s.name == "router.request"]
        trace_id = f"{root.context.trace_id:032x}"
        root_id = f"{root.context.span_id:016x}"
        spans = wait_for(receiver, trace_id, 2)
        nodes = {s["attributes"]["pdcluster.node"]: s for s in spans
                 if s["name"] == "node.request"}
        assert set(nodes) == {"p0", "d0"}
        assert all(s["parent"] == root_id for s in nodes.values())
        assert nodes["p0"]["attributes"]["pdcluster.transfer"] == "remote_decode"
        assert nodes["d0"]["attributes"]["pdcluster.transfer"] == "remote_prefill"
        children = {(s["parent"], s["name"]): s for s in spans}
        wait = children[(nodes["d0"]["span"], "kv.wait")]
        decode = children[(nodes["d0"]["span"], "node.decode")]
        assert (nodes["p0"]["span"], "node.prefill") in children
        assert wait["end"] <= decode["start"] + 1 and decode["end"] <= nodes["d0"]["end"]
        assert root.attributes["pdcluster.prefill_node"] == "p0"
        spans = wait_for(receiver, trace_id, 1, name="kv.send")
        transfer = {s["name"]: s for s in spans if s["name"] in ("kv.send", "kv.recv")}
        assert transfer["kv.send"]["attributes"]["pdcluster.node"] == "p0"
        assert transfer["kv.recv"]["attributes"]["pdcluster.node"] == "d0"
        assert all(s["parent"] == root_id for s in transfer.values())
        send, recv = transfer["kv.send"], transfer["kv.recv"]
        assert wait["start"] <= recv["start"] <= send["start"] <= send["end"] <= recv["end"]
        assert recv["end"] <= wait["end"]

        client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
        router.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
            extra_headers={"traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"})
        assert wait_for(receiver, client_trace, 1)
    finally:
        router.stop()
