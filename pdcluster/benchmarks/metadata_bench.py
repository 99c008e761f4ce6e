"""Metadata-service benchmark: `pdcluster bench metadata [--json]`.

Starts its own etcd on loopback (unless --no-etcd) and the service as a separate process
(`pdcluster metadata serve --backend etcd`, so client and server do not share a GIL), then:

1. registers N nodes and ingests B distinct block hashes over gRPC (4 client threads, batches
   of 2,048 hashes) -> ``ingest_events_per_s``; etcd writes during it ->
   ``etcd_writes_per_s_per_node``;
2. waits until etcd holds everything (``etcd_drain_s``), then times prefix queries of
   128-block chains (hot chains held by 8 nodes with random prefix lengths, so the walk goes
   deep) interleaved with empty RPCs -> ``query_p50_ms``,
   ``query_p99_ms`` and the floor ``grpc_noop_p50_ms``, measured in the same run;
3. kills the service (SIGKILL) once etcd holds everything and restarts it -> ``recovery_s``
   (spawn to an index with the same size and the same answer);
4. builds the same index in this process -> ``inproc_query_us`` and ``bytes_per_block``
   (resident-memory growth per distinct block).

Prints progress on stderr; the CLI prints the JSON object last.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdcluster.benchmarks.ports import free_port
from pdcluster.core.block_index import BlockIndex
from pdcluster.core.credentials import SECRET_ENV, SECRET_FILE_ENV, ClusterSecret, node_principal
from pdcluster.metadata_service.client import MetadataClient, make_node_info
from pdcluster.proto import metadata_pb2 as pb

HASH = 32
BATCH_HASHES = 2048
EVENT_HASHES = 64
HOT_CHAINS = 16
HOT_HOLDERS = 8
INGEST_THREADS = 4


def _log(msg: str) -> None:
    print(f"[metadata-bench] {msg}", file=sys.stderr, flush=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Population:
    """N nodes' packed block sets: mostly private blocks, plus hot chains shared by prefix."""

    def __init__(self, num_nodes: int, num_blocks: int, chain_len: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.node_ids = [f"node-{i:03d}" for i in range(num_nodes)]
        self.hot = [rng.randbytes(HASH * chain_len) for _ in range(HOT_CHAINS)]
        private = num_blocks - HOT_CHAINS * chain_len
        packed = rng.randbytes(HASH * private)
        per_node = private // num_nodes
        self.packed: dict[str, list[bytes]] = {}
        for i, node_id in enumerate(self.node_ids):
            end = len(packed) if i == num_nodes - 1 else (i + 1) * per_node * HASH
            self.packed[node_id] = [packed[i * per_node * HASH:end]]
        for chain in self.hot:
            for node_id in rng.sample(self.node_ids, HOT_HOLDERS):
                depth = rng.randint(1, chain_len)
                self.packed[node_id].append(chain[:depth * HASH])
        self.num_blocks = private + HOT_CHAINS * chain_len

    def batches(self, node_id: str) -> list[list[pb.KVEventMsg]]:
        data = b"".join(self.packed[node_id])
        step, out = EVENT_HASHES * HASH, []
        events = [pb.KVEventMsg(stored=pb.BlockStoredEvent(block_hashes=data[i:i + step],
                                                           block_size=16))
                  for i in range(0, len(data), step)]
        per_batch = BATCH_HASHES // EVENT_HASHES
        for i in range(0, len(events), per_batch):
            out.append(events[i:i + per_batch])
        return out


class _Etcd:
    def __init__(self, folder: Path) -> None:
        self.port, peer = free_port(), free_port()
        url, peer_url = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "bench", "--data-dir", str(folder / "etcd"),
             "--listen-client-urls", url, "--advertise-client-urls", url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"bench={peer_url}", "--log-level", "error",
             "--quota-backend-bytes", str(4 * 1024**3)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_service(port: int, etcd_port: int | None, secret: ClusterSecret) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdcluster.cluster.cli", "metadata", "serve", "--port", str(port),
           "--lease-ttl", "300"]
    if etcd_port is not None:
        cmd += ["--backend", "etcd", "--etcd", f"127.0.0.1:{etcd_port}"]
    env = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                            env={**env, SECRET_ENV: secret.to_text()})


def node_client(address: str, secret: ClusterSecret, node_id: str) -> MetadataClient:
    """A node may act only as itself: one client (credential) per node."""
    return MetadataClient(address, cluster_secret=secret, principal=node_principal(node_id),
                          timeout_s=30)


def wait_ready(client: MetadataClient, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def ingest(address: str, pop: Population, infos: dict[str, pb.NodeInfo],
           secret: ClusterSecret) -> float:
    groups = [pop.node_ids[i::INGEST_THREADS] for i in range(INGEST_THREADS)]
    work = {n: pop.batches(n) for n in pop.node_ids}
    errors: list[BaseException] = []

    def run(node_ids: list[str]) -> None:
        try:
            for node_id in node_ids:
                with node_client(address, secret, node_id) as client:
                    for seq, events in enumerate(work[node_id], start=1):
                        reply = client.publish_raw(pb.PublishRequest(
                            node_id=node_id, epoch=infos[node_id].epoch, seq=seq, events=events))
                        assert reply.status == pb.PublishReply.OK, reply
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def _latencies(client: MetadataClient, chains: list[list[bytes]], n: int) -> tuple[list, list]:
    query_ms, noop_ms = [], []
    for i in range(n):
        chain = chains[i % len(chains)]
        t0 = time.perf_counter()
        client.query(chain)
        t1 = time.perf_counter()
        client.ping()
        t2 = time.perf_counter()
        query_ms.append((t1 - t0) * 1e3)
        noop_ms.append((t2 - t1) * 1e3)
    return query_ms, noop_ms


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _inproc(pop: Population, chains: list[list[bytes]]) -> tuple[float, float]:
    """(query microseconds, resident bytes per distinct block) of the index alone."""
    before = _rss_bytes()
    index = BlockIndex()
    for node_id, parts in pop.packed.items():
        index.add_node(node_id)
        data = b"".join(parts)
        index.add_blocks(node_id, [data[i:i + HASH] for i in range(0, len(data), HASH)])
    grown = _rss_bytes() - before
    reps = 2000
    t0 = time.perf_counter()
    for i in range(reps):
        index.query(chains[i % len(chains)])
    per_query_us = (time.perf_counter() - t0) / reps * 1e6
    return per_query_us, grown / index.num_blocks


def run(args: argparse.Namespace) -> dict:
    nodes, blocks, queries = args.nodes, args.blocks, args.queries
    if args.quick:
        nodes, blocks, queries = min(nodes, 8), min(blocks, 50_000), min(queries, 300)
    use_etcd = not args.no_etcd and shutil.which("etcd") is not None
    pop = Population(nodes, blocks, args.chain)
    chains = [[c[i:i + HASH] for i in range(0, len(c), HASH)] for c in pop.hot]
    result: dict = {"nodes": nodes, "blocks": pop.num_blocks, "chain_blocks": args.chain,
                    "backend": "etcd" if use_etcd else "memory"}
    with tempfile.TemporaryDirectory(prefix="metadata-bench-") as tmp:
        etcd = _Etcd(Path(tmp)) if use_etcd else None
        port = free_port()
        secret = ClusterSecret.generate()
        procs = {"service": start_service(port, etcd.port if etcd else None, secret)}
        address = f"127.0.0.1:{port}"
        try:
            with MetadataClient(address, cluster_secret=secret, timeout_s=30) as client:
                wait_ready(client)
                infos = {n: make_node_info(n, "prefill") for n in pop.node_ids}
                for info in infos.values():
                    with node_client(address, secret, info.node_id) as node:
                        node.register(info, 300)
                time.sleep(0.5)  # let the first (lease + empty base) writes go out
                writes0 = client.stats().etcd_writes
                _log(f"ingesting {pop.num_blocks} blocks into {nodes} nodes")
                ingest_s = ingest(address, pop, infos, secret)
                writes = client.stats().etcd_writes - writes0
                result["ingest_events_per_s"] = round(pop.num_blocks / ingest_s)
                result["etcd_writes_per_s_per_node"] = round(writes / ingest_s / nodes, 2)
                result["etcd_drain_s"] = round(_drain(client), 2)
                _log(f"timing {queries} queries")
                query_ms, noop_ms = _latencies(client, chains, queries)
                result.update(query_p50_ms=round(_pct(query_ms, 0.5), 3),
                              query_p99_ms=round(_pct(query_ms, 0.99), 3),
                              grpc_noop_p50_ms=round(_pct(noop_ms, 0.5), 3),
                              grpc_noop_p99_ms=round(_pct(noop_ms, 0.99), 3),
                              query_mean_ms=round(statistics.fmean(query_ms), 3))
                expected = [client.query(c) for c in chains]
                if etcd is not None:
                    result["recovery_s"] = _recover(client, expected, chains, procs, port,
                                                    etcd.port, secret)
        finally:
            procs["service"].kill()
            procs["service"].wait()
            if etcd is not None:
                etcd.stop()
    _log("in-process index")
    inproc_us, per_block = _inproc(pop, chains)
    result["inproc_query_us"] = round(inproc_us, 2)
    result["bytes_per_block"] = round(per_block, 1)
    result["query_over_noop"] = round(result["query_p50_ms"] / result["grpc_noop_p50_ms"], 2)
    result["targets"] = {"query_p99_ms": 2.0, "ingest_events_per_s": 100_000, "recovery_s": 5.0}
    return result


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _drain(client: MetadataClient) -> float:
    """Seconds until etcd holds every change (0 with the memory backend)."""
    started = time.perf_counter()
    deadline = time.monotonic() + 120
    while client.stats().persistence_pending_nodes:
        if time.monotonic() > deadline:
            raise RuntimeError("etcd persistence did not drain in 120 s")
        time.sleep(0.05)
    return time.perf_counter() - started


def _recover(client: MetadataClient, expected: list, chains: list, procs: dict, port: int,
             etcd_port: int, secret: ClusterSecret) -> float:
    """Kill the service once etcd holds everything; seconds from respawn to the same index."""
    want = client.stats().num_blocks
    _drain(client)
    _log("killing and restarting the service")
    procs["service"].kill()
    procs["service"].wait()
    started = time.perf_counter()
    procs["service"] = start_service(port, etcd_port, secret)
    # The server listens only after it rebuilt the index from etcd; a fresh channel then
    # avoids gRPC's reconnect backoff skewing the measurement.
    while not _port_open(port):
        time.sleep(0.005)
    with MetadataClient(f"127.0.0.1:{port}", cluster_secret=secret, timeout_s=30) as fresh:
        wait_ready(fresh)
        got = fresh.stats().num_blocks
        same = [fresh.query(c) for c in chains] == expected
    elapsed = time.perf_counter() - started
    if got != want or not same:
        raise RuntimeError(f"recovered {got} blocks (want {want}); same answers: {same}")
    return round(elapsed, 3)
