"""Router benchmark: `pdcluster bench router [--json] [--quick]` — the router's own cost.

Setup, all on 127.0.0.1: the metadata service (its own process) indexing 1,000,000 blocks over
64 registered nodes (32 prefill, 32 decode), whose request addresses are "instant" node
servers in this process (they answer every request at once, so what is timed is the router);
`pdcluster router serve` in its own process, pointed at that metadata service.

- `route_decision_p99_us`: the decision alone — the index's prefix walk over the request's
  block hashes (1M blocks, 64 nodes) plus `Dispatcher.decide` (views refreshed, the policy)
  over the 64 nodes;
- `overhead_p50_ms` / `overhead_p99_ms`: a completion through the router (HTTP, tokenizing,
  hashing, the prefix lookup in the router's mirror of the index, ZMQ to the node and back)
  minus the same request sent straight to the node over ZMQ, same run; timed once the router
  reports its mirror in sync (the service streamed it the whole index);
- `requests_per_s` with 64 concurrent streaming clients.
Node sockets speak ZMQ CURVE, as in a cluster (the router holds the cluster secret); the price
of it is measured in the same run: `direct_node_p50_ms` (CURVE) against
`direct_node_plain_p50_ms`, the same instant node on a plaintext socket.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

import zmq

from pdcluster.benchmarks.metadata_bench import (
    HASH,
    Population,
    free_port,
    ingest,
    node_client,
    start_service,
    wait_ready,
)
from pdcluster.core.credentials import SECRET_ENV, SECRET_FILE_ENV, ClusterSecret, CurveKeys
from pdcluster.core.curve import secure_server
from pdcluster.core.node_wire import (
    GenerateRequest,
    LoadQuery,
    LoadReport,
    SamplingSpec,
    TokenDelta,
    decode,
    encode,
)


@dataclass(frozen=True, slots=True)
class Sizes:
    nodes: int = 64
    blocks: int = 1_000_000
    samples: int = 1000
    concurrency: int = 64
    load_requests: int = 2000


QUICK = Sizes(nodes=16, blocks=50_000, samples=200, concurrency=16, load_requests=200)


class InstantNode:
    """A node server that answers every request at once: one TokenDelta with all tokens.
    A CURVE server with `curve` (as real nodes are), plaintext with None."""

    def __init__(self, curve: CurveKeys | None) -> None:
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            secure_server(self._socket, curve)
        self.address = f"tcp://127.0.0.1:{self._socket.bind_to_random_port('tcp://127.0.0.1')}"
        self._rng = random.Random(len(self.address))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(50):
                continue
            identity, frame = self._socket.recv_multipart()
            msg = decode(frame)
            reply: LoadReport | TokenDelta
            if isinstance(msg, LoadQuery):  # varied loads, so the policy has work to do
                queued = self._rng.randrange(500)
                reply = LoadReport("instant", "decode", 0, queued % 5, 1000 - queued, 1000,
                                   queued)
            elif isinstance(msg, GenerateRequest):
                n = msg.sampling.max_tokens
                reply = TokenDelta(msg.request_id, [100 + i for i in range(n)], True, "length",
                                   None, len(msg.prompt_token_ids), 0)
            else:
                continue
            self._socket.send_multipart([identity, encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close()


def run(args: argparse.Namespace) -> dict:
    from pdcluster.engine.tiny_model import make_tiny_model

    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    with tempfile.TemporaryDirectory(prefix="pdcluster-router-bench-") as tmp:
        model = str(make_tiny_model(f"{tmp}/model"))
        secret = ClusterSecret.generate()
        nodes = [InstantNode(secret.curve_keys()) for _ in range(4)]
        plain = InstantNode(None)
        meta_port = free_port()
        procs = [start_service(meta_port, None, secret)]
        try:
            result = _measure(sizes, model, nodes, meta_port, procs, secret)
            keys = secret.curve_keys()
            direct = _direct_ms(nodes[0].address, sizes.samples, keys)
            direct_plain = _direct_ms(plain.address, sizes.samples, None)
            result["direct_node_plain_p50_ms"] = round(statistics.median(direct_plain), 3)
            result["curve_cost_p50_ms"] = round(statistics.median(direct)
                                                - statistics.median(direct_plain), 3)
            return {**asdict(sizes), **result}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            for node in [*nodes, plain]:
                node.close()


def _measure(sizes: Sizes, model: str, nodes: list[InstantNode], meta_port: int,
             procs: list, secret: ClusterSecret) -> dict:
    pop = Population(sizes.nodes, sizes.blocks, 128)
    prompts = _prompts(model)
    _populate(f"127.0.0.1:{meta_port}", pop, nodes, secret)
    decision_us = _decisions(pop, nodes, model, sizes.samples, secret)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "pdcluster.cluster.cli", "router", "serve", "--model", model,
         "--metadata", f"127.0.0.1:{meta_port}", "--port", str(port)],
        env={**env, SECRET_ENV: secret.to_text()},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_healthy(port, sizes.nodes)
    direct = _direct_ms(nodes[0].address, sizes.samples, secret.curve_keys())
    routed = _routed_ms(port, prompts, sizes.samples)
    rps = asyncio.run(_load(port, prompts, sizes))
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1]  # noqa: E731
    return {
        "route_decision_p50_us": round(pct(decision_us, 50), 1),
        "route_decision_p99_us": round(pct(decision_us, 99), 1),
        "direct_node_p50_ms": round(pct(direct, 50), 3),
        "router_p50_ms": round(pct(routed, 50), 3),
        "overhead_p50_ms": round(pct(routed, 50) - pct(direct, 50), 3),
        "overhead_p99_ms": round(pct(routed, 99) - pct(direct, 99), 3),
        "requests_per_s": round(rps, 1),
        "targets": {"route_decision_p99_us": 200, "overhead_p99_ms": 5},
    }


def _prompts(model: str) -> list[str]:
    rng = random.Random(0)
    system = "You are a helpful assistant. " * 20  # a shared prefix, as real traffic has
    return [system + " ".join(f"w{rng.randrange(1000)}" for _ in range(30)) for _ in range(64)]


def _populate(address: str, pop: Population, nodes: list[InstantNode],
              secret: ClusterSecret) -> None:
    """Register the nodes (each with its own credential) and ingest the 1M-block
    population."""
    from pdcluster.metadata_service.client import MetadataClient, make_node_info

    infos = {}
    with MetadataClient(address, cluster_secret=secret, timeout_s=30) as client:
        wait_ready(client)
    for i, node_id in enumerate(pop.node_ids):
        role = "prefill" if i % 2 == 0 else "decode"
        infos[node_id] = make_node_info(node_id, role, request_address=nodes[i % 4].address,
                                        kv_address="tcp://127.0.0.1:9")
        with node_client(address, secret, node_id) as client:
            client.register(infos[node_id], 300)
    ingest(address, pop, infos, secret)


def _decisions(pop: Population, nodes: list[InstantNode], model: str, samples: int,
               secret: ClusterSecret) -> list[float]:
    """Microseconds per decision: the index walk over the request's chain, then the live
    router's `Dispatcher.decide` (views refreshed in place, the policy) over the 64 nodes,
    whose load it has polled from the instant nodes like the live router."""
    from pdcluster.core.block_index import BlockIndex
    from pdcluster.router.config import NodeSpec, RouterConfig
    from pdcluster.router.metrics import RouterMetrics
    from pdcluster.router.routing.dispatch import Dispatcher

    index = BlockIndex()
    for node_id, parts in pop.packed.items():
        index.add_node(node_id)
        data = b"".join(parts)
        index.add_blocks(node_id, [data[i:i + HASH] for i in range(0, len(data), HASH)])
    chains = [[c[i:i + HASH] for i in range(0, len(c), HASH)] for c in pop.hot]
    specs = tuple(NodeSpec(n, "prefill" if i % 2 == 0 else "decode", nodes[i % 4].address,
                           "tcp://127.0.0.1:9") for i, n in enumerate(pop.node_ids))
    config = RouterConfig(model_dir=model, nodes=specs, seed=0, cluster_secret=secret)

    async def measure() -> list[float]:
        dispatcher, out = Dispatcher(config, RouterMetrics()), []
        await dispatcher.start()
        try:
            for i in range(samples):
                chain = chains[i % len(chains)]
                start = time.perf_counter()
                dispatcher.decide(dict(index.query(chain)), len(chain) * 16 + 100)
                out.append((time.perf_counter() - start) * 1e6)
        finally:
            await dispatcher.close()
        return out

    return asyncio.run(measure())


def _wait_healthy(port: int, num_nodes: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            body = json.loads(conn.getresponse().read() or b"{}")
            healthy = sum(n.get("healthy", False) for n in body.get("nodes", {}).values())
            if healthy == num_nodes and (body.get("metadata") or {}).get("mirror_in_sync"):
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the router did not see every node healthy and its index in sync")


def _direct_ms(address: str, samples: int, curve: CurveKeys | None) -> list[float]:
    from pdcluster.node.client import BlockingNodeClient

    client, out = BlockingNodeClient(address, curve=curve), []
    ids = list(range(3, 203))  # a prompt of the same order of length, already tokenized
    for i in range(samples + 20):
        start = time.perf_counter()
        client.send(GenerateRequest(f"direct-{i}", ids, SamplingSpec(max_tokens=1)))
        client.recv(10)
        if i >= 20:  # warm-up excluded
            out.append((time.perf_counter() - start) * 1e3)
    client.close()
    return out


def _routed_ms(port: int, prompts: list[str], samples: int) -> list[float]:
    conn, out = http.client.HTTPConnection("127.0.0.1", port, timeout=30), []
    for i in range(samples + 20):
        body = json.dumps({"model": "model", "prompt": prompts[i % len(prompts)],
                           "max_tokens": 1})
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"router answered {response.status}")
        if i >= 20:
            out.append((time.perf_counter() - start) * 1e3)
    conn.close()
    return out


async def _load(port: int, prompts: list[str], sizes: Sizes) -> float:
    """Requests per second with `concurrency` clients streaming completions."""
    import aiohttp

    url = f"http://127.0.0.1:{port}/v1/completions"
    counter = iter(range(sizes.load_requests))

    async def client(session) -> None:
        for i in counter:
            payload = {"model": "model", "prompt": prompts[i % len(prompts)],
                       "max_tokens": 8, "stream": True}
            async with session.post(url, json=payload) as response:
                if response.status != 200:
                    raise RuntimeError(f"router answered {response.status}")
                async for _ in response.content:
                    pass

    connector = aiohttp.TCPConnector(limit=sizes.concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(sizes.concurrency)))
        return sizes.load_requests / (time.perf_counter() - start)
