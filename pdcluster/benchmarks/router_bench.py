"""Router benchmark: `pdcluster bench router [--json] [--quick]` — the router's own cost.

Setup, all on 127.0.0.1: the metadata service (its own process) indexing 1,000,000 blocks over
64 registered nodes (32 prefill, 32 decode), whose request addresses are "instant" node
servers in this process (they answer every request at once, so what is timed is the router;
4 threads serve the 64, each node id with its own socket and key, as the metadata service
refuses live nodes that share an address or a key);
`pdcluster router serve` in its own process, pointed at that metadata service.

- `route_decision_p99_us`: the decision alone — the index's prefix walk over the request's
  block hashes (1M blocks, 64 nodes) plus `Dispatcher.decide` (views refreshed, the policy)
  over the 64 nodes;
- `overhead_p50_ms` / `overhead_p99_ms`: a completion through the router (HTTP, tokenizing,
  hashing, the prefix lookup in the router's mirror of the index, ZMQ to the node and back)
  minus the same request sent straight to the node over ZMQ, same run; timed once the router
  reports its mirror in sync (the service streamed it the whole index);
- `requests_per_s` with 64 concurrent streaming clients.
Node sockets speak ZMQ CURVE and check each message's principal, as in a cluster (the router
holds its client credential only and registers its own key; the instant nodes follow the
metadata service's router keys). The price of both is measured in the same run, the same
request straight to an instant node of each kind (benchmarks/instant_node.py):
`direct_node_plain_p50_ms` (plaintext), `direct_node_shared_p50_ms` (CURVE, one shared key
pair), `direct_node_p50_ms` (CURVE, own keys, per-principal checks): `curve_cost_p50_ms` and
`identity_checks_cost_p50_ms` are the differences, `identity_checks_ratio` the last ratio.
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
import time
from dataclasses import asdict, dataclass

from pdcluster.benchmarks.instant_node import InstantNode
from pdcluster.benchmarks.metadata_bench import (
    HASH,
    Population,
    ingest,
    node_client,
    start_service,
    wait_ready,
)
from pdcluster.benchmarks.ports import free_port
from pdcluster.core.credentials import (
    ROUTER_TOKEN_ENV,
    SECRET_ENV,
    SECRET_FILE_ENV,
    SERVICE,
    ClusterSecret,
    CurveKeys,
)
from pdcluster.core.node_wire import GenerateRequest, SamplingSpec
from pdcluster.metadata_service.client import MetadataClient


@dataclass(frozen=True, slots=True)
class Sizes:
    nodes: int = 64
    blocks: int = 1_000_000
    samples: int = 1000
    concurrency: int = 64
    load_requests: int = 2000


QUICK = Sizes(nodes=16, blocks=50_000, samples=200, concurrency=16, load_requests=200)


def run(args: argparse.Namespace) -> dict:
    from pdcluster.engine.models.tiny_model import make_tiny_model

    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    with tempfile.TemporaryDirectory(prefix="pdcluster-router-bench-") as tmp:
        model = str(make_tiny_model(f"{tmp}/model"))
        secret = ClusterSecret.generate()
        meta_port = free_port()
        procs = [start_service(meta_port, None, secret)]
        address = f"127.0.0.1:{meta_port}"
        with MetadataClient(address, token=secret.metadata_token(SERVICE), timeout_s=30) as c:
            wait_ready(c)
        nodes = {mode: [InstantNode(mode, secret, address) for _ in range(4)]
                 for mode in ("identity", "shared")}
        nodes["plain"] = [InstantNode("plain", secret)]
        # the registered node ids, one endpoint (address, key) each, the metadata service
        # refusing live nodes that share either; 4 threads serve them, as 4 nodes did
        per_node = -(-sizes.nodes // 4)
        registered = [InstantNode("identity", secret, address, per_node) for _ in range(4)]
        try:
            result = _measure(sizes, model, nodes, registered, meta_port, procs, secret)
            return {**asdict(sizes), **result, **_direct(sizes, nodes, address, secret)}
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            for node in [n for group in [*nodes.values(), registered] for n in group]:
                node.close()


def _direct(sizes: Sizes, nodes: dict[str, list[InstantNode]], address: str,
            secret: ClusterSecret) -> dict:
    """The same request straight to one instant node of each mode, this run: what CURVE
    costs (shared against plain) and what the per-principal checks add (identity against
    shared), the client a registered router in identity mode."""
    router = CurveKeys.generate()
    with MetadataClient(address, token=secret.metadata_token(SERVICE), timeout_s=30) as c:
        c.register_client("bench-direct", router.public, 600)
    targets = {mode: (group[0].address, None if mode == "plain" else
                      (router if mode == "identity" else group[0].keys),
                      group[0].keys.public if mode == "identity" else None)
               for mode, group in nodes.items()}
    p50 = {mode: statistics.median(ms) for mode, ms in _direct_ms(targets, sizes.samples).items()}
    return {"direct_node_plain_p50_ms": round(p50["plain"], 3),
            "direct_node_shared_p50_ms": round(p50["shared"], 3),
            "curve_cost_p50_ms": round(p50["shared"] - p50["plain"], 3),
            "identity_checks_cost_p50_ms": round(p50["identity"] - p50["shared"], 3),
            "identity_checks_ratio": round(p50["identity"] / p50["shared"], 3)}


def _measure(sizes: Sizes, model: str, nodes: dict[str, list[InstantNode]],
             registered: list[InstantNode], meta_port: int, procs: list,
             secret: ClusterSecret) -> dict:
    pop = Population(sizes.nodes, sizes.blocks, 128)
    prompts = _prompts(model)
    _populate(f"127.0.0.1:{meta_port}", pop, registered, secret, model)
    decision_us = _decisions(pop, nodes["shared"], model, sizes.samples, secret)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_FILE_ENV, SECRET_ENV)}
    procs.append(subprocess.Popen(  # the router gets its client credential, never the secret
        [sys.executable, "-m", "pdcluster.cluster.cli", "router", "serve", "--model", model,
         "--metadata", f"127.0.0.1:{meta_port}", "--port", str(port)],
        env={**env, ROUTER_TOKEN_ENV: secret.metadata_token(SERVICE)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_healthy(port, sizes.nodes)
    router = CurveKeys.generate()
    with MetadataClient(f"127.0.0.1:{meta_port}", token=secret.metadata_token(SERVICE)) as c:
        c.register_client("bench-measure", router.public, 600)
    node = nodes["identity"][0]
    direct = _direct_ms({"identity": (node.address, router, node.keys.public)},
                        sizes.samples)["identity"]
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
              secret: ClusterSecret, model: str) -> None:
    """Register the nodes (each with its own credential and the KV identity of a node
    serving `model`, which the router takes) and ingest the 1M-block population."""
    from pdcluster.metadata_service.client import make_node_info

    identity = _identity(model)
    infos = {}
    for i, node_id in enumerate(pop.node_ids):
        role = "prefill" if i % 2 == 0 else "decode"
        request_address, keys = nodes[i % len(nodes)].endpoints[i // len(nodes)]
        infos[node_id] = make_node_info(node_id, role, request_address=request_address,
                                        kv_address=f"tcp://127.0.0.1:{10_000 + i}",
                                        identity=identity, curve_public_key=keys.public)
        with node_client(address, secret, node_id) as client:
            client.register(infos[node_id], 300)
    ingest(address, pop, infos, secret)


def _identity(model: str):
    """The KV identity of the nodes the bench stands in for (blocks of 16 tokens, the own
    engine's hashes, `model`'s tokenizer): the cluster's, for the router."""
    from pdcluster.core.hashing import DEFAULT_HASH_CONFIG
    from pdcluster.core.kv_identity import KVIdentity

    return KVIdentity.of(16, DEFAULT_HASH_CONFIG, model)


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
    config = RouterConfig(model_dir=model, nodes=specs, seed=0,
                          cluster_identity=_identity(model))

    async def measure() -> list[float]:
        dispatcher, out = Dispatcher(config, RouterMetrics(),
                                     shared_keys=secret.curve_keys()), []
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


def _direct_ms(targets: dict[str, tuple[str, CurveKeys | None, bytes | None]],
               samples: int) -> dict[str, list[float]]:
    """Per mode (address, client keys, server key): the same request's round trip straight to
    its node, the modes taking turns in a rotating order so a neighbour's burst slows each
    alike (measured one mode after another, the ratios swung with the machine's noise)."""
    from pdcluster.node.client import BlockingNodeClient

    clients = {mode: BlockingNodeClient(address, curve=curve, server_key=server_key)
               for mode, (address, curve, server_key) in targets.items()}
    modes = list(clients)
    out: dict[str, list[float]] = {mode: [] for mode in clients}
    ids = list(range(3, 203))  # a prompt of the same order of length, already tokenized
    for i in range(samples + 20):
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            start = time.perf_counter()
            clients[mode].send(GenerateRequest(f"direct-{mode}-{i}", ids,
                                               SamplingSpec(max_tokens=1)))
            clients[mode].recv(10)
            if i >= 20:  # warm-up excluded
                out[mode].append((time.perf_counter() - start) * 1e3)
    for client in clients.values():
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
