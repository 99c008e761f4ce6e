"""KV transfer benchmark: `pdcluster bench transfer [--json] [--quick]`.

Two processes on 127.0.0.1. Each holds a KV region in the engine's real layout (the `bench`
model preset: 8 layers, 4 KV heads, head_dim 64, float32, 16-token blocks = 256 KiB a block,
so a 4,096-token request is 64 MiB). The prefill side runs the production `ConnectorWorker`
over `MooncakeTransport`; the decode side (this process) issues receives through its own
worker, exactly as the engine does, and times plan -> `RecvResult`:

- `connector_gbps`: one request of 4,096 tokens, and 32 such requests at once;
- `raw_mooncake_gbps`: one contiguous `batch_transfer_sync_write` of the same bytes between
  the same two processes (the baseline), measured in the same run;
- `efficiency` = connector / raw; `descriptors_per_request`; `handshake_ms`: a transfer of zero
  blocks — the side-channel round trip alone (CURVE-encrypted, as in a cluster; `pdcluster
  bench curve` prices CURVE against plaintext).
Bytes are checked after the run (a wrong copy fails the benchmark).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

BLOCK_SIZE, LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 16, 8, 4, 64, 4


@dataclass(frozen=True, slots=True)
class Sizes:
    tokens_per_request: int = 4096
    num_requests: int = 32
    repeats: int = 3


QUICK = Sizes(tokens_per_request=1024, num_requests=4, repeats=2)


def _spec(num_blocks: int):
    from pdcluster.engine.kv.kv_cache import KVCacheSpec

    return KVCacheSpec(num_blocks, LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, DTYPE_BYTES)


def _region(num_blocks: int, fill: int | None):
    """A KV-layout buffer (numpy: no torch needed to move bytes) and its KVRegion."""
    import numpy as np

    from pdcluster.core.kv_connector import KVRegion

    spec = _spec(num_blocks)
    buf = np.zeros(spec.total_nbytes, dtype=np.uint8)
    if fill is not None:
        buf[:] = np.random.default_rng(fill).integers(0, 255, spec.total_nbytes, dtype=np.uint8)
    region = KVRegion(buf.ctypes.data, spec.total_nbytes, spec.block_nbytes, num_blocks)
    return buf, region


def _prefill_side(conn, num_blocks: int, secret_text: str) -> None:
    """Child: serve SendJobs, and time raw Mooncake writes on request."""
    from pdcluster.core.credentials import ClusterSecret
    from pdcluster.core.kv_connector import ConnectorPlan, SendJob
    from pdcluster.core.kv_transfer import RemoteDecode
    from pdcluster.transfer.connector_worker import ConnectorWorker
    from pdcluster.transfer.transport import MooncakeTransport

    buf, region = _region(num_blocks, fill=7)
    transport = MooncakeTransport(curve=ClusterSecret.from_text(secret_text).curve_keys())
    worker = ConnectorWorker(transport, timeout_s=120)
    worker.register_kv_region(region)
    conn.send((transport.reply_address, transport.session_id))
    while True:
        cmd, *args = conn.recv()
        if cmd == "send":
            jobs = [SendJob(rid, RemoteDecode(tid), blocks, 0) for rid, tid, blocks in args[0]]
            worker.execute(ConnectorPlan(sends=jobs))
        elif cmd == "raw":
            session, dst_addr, nbytes = args
            start = time.perf_counter()
            transport.write(session, [region.base_addr], [dst_addr], [nbytes])
            conn.send(time.perf_counter() - start)
        elif cmd == "checksum":
            conn.send(int(buf[: args[0]].sum(dtype="uint64")))
        elif cmd == "stop":
            worker.close()
            return
        worker.get_results()  # releases: nothing else to do with them here


class _Bench:
    def __init__(self, sizes: Sizes) -> None:
        from pdcluster.core.credentials import ClusterSecret
        from pdcluster.transfer.connector_worker import ConnectorWorker
        from pdcluster.transfer.transport import MooncakeTransport

        self.sizes = sizes
        self.blocks_per_request = sizes.tokens_per_request // BLOCK_SIZE
        self.num_blocks = self.blocks_per_request * sizes.num_requests
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        secret = ClusterSecret.generate()  # the side channel speaks CURVE, as in a cluster
        self.child = ctx.Process(target=_prefill_side,
                                 args=(child, self.num_blocks, secret.to_text()), daemon=True)
        self.child.start()
        self.peer_addr, _ = self.conn.recv()
        self.buf, self.region = _region(self.num_blocks, fill=None)
        self.transport = MooncakeTransport(curve=secret.curve_keys())
        self.worker = ConnectorWorker(self.transport, timeout_s=120)
        self.worker.register_kv_region(self.region)
        self._ids = iter(range(10**9))

    def connector(self, num_requests: int, blocks: int | None = None) -> tuple[float, int]:
        """Seconds from plan to the last RecvResult, and descriptors used."""
        from pdcluster.core.kv_connector import ConnectorPlan, RecvJob
        from pdcluster.core.kv_transfer import RemotePrefill

        blocks = self.blocks_per_request if blocks is None else blocks
        sends, recvs = [], []
        for r in range(num_requests):
            n = next(self._ids)
            ids = list(range(r * blocks, (r + 1) * blocks))
            sends.append((f"p{n}", f"t{n}", ids))
            recvs.append(RecvJob(f"d{n}", RemotePrefill(f"t{n}", self.peer_addr), ids, 0))
        self.conn.send(("send", sends))
        descriptors_before = self.worker.stats.descriptors_received
        start = time.perf_counter()
        self.worker.execute(ConnectorPlan(recvs=recvs))
        done = 0
        while done < num_requests:
            results = self.worker.get_results().received
            if any(not r.ok for r in results):
                raise RuntimeError(f"transfer failed: {[r.error for r in results]}")
            done += len(results)
            time.sleep(0.0002)
        elapsed = time.perf_counter() - start
        return elapsed, self.worker.stats.descriptors_received - descriptors_before

    def raw(self, nbytes: int) -> float:
        self.conn.send(("raw", self.transport.session_id, self.region.base_addr, nbytes))
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("stop",))
        self.child.join(30)
        self.worker.close()

    def checksums_match(self, nbytes: int) -> bool:
        self.conn.send(("checksum", nbytes))
        return int(self.buf[:nbytes].sum(dtype="uint64")) == self.conn.recv()


def run(args: argparse.Namespace) -> dict:
    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    bench = _Bench(sizes)
    try:
        return _measure(bench, sizes)
    finally:
        bench.close()


def _measure(bench: _Bench, sizes: Sizes) -> dict:
    one = bench.blocks_per_request * bench.region.block_nbytes
    bench.connector(1)  # warm-up: connection set-up to a new peer costs up to ~1 s
    bench.raw(one)
    handshake = statistics.median(bench.connector(1, blocks=0)[0] for _ in range(5))
    t_one, d_one = zip(*(bench.connector(1) for _ in range(sizes.repeats)), strict=True)
    t_all, d_all = zip(*(bench.connector(sizes.num_requests) for _ in range(sizes.repeats)),
                       strict=True)
    raw_one = statistics.median(bench.raw(one) for _ in range(sizes.repeats))
    raw_all = statistics.median(bench.raw(one * sizes.num_requests)
                                for _ in range(sizes.repeats))
    if not bench.checksums_match(one * sizes.num_requests):
        raise RuntimeError("received KV differs from the sender's")
    gbps = lambda nbytes, secs: nbytes / secs / 1e9  # noqa: E731
    conn_one, conn_all = gbps(one, statistics.median(t_one)), gbps(
        one * sizes.num_requests, statistics.median(t_all))
    raw_one_gbps, raw_all_gbps = gbps(one, raw_one), gbps(one * sizes.num_requests, raw_all)
    return {
        "tokens_per_request": sizes.tokens_per_request, "num_requests": sizes.num_requests,
        "bytes_per_request": one, "block_nbytes": bench.region.block_nbytes,
        "connector_gbps": round(conn_all, 3), "raw_mooncake_gbps": round(raw_all_gbps, 3),
        "efficiency": round(conn_all / raw_all_gbps, 3),
        "connector_gbps_1req": round(conn_one, 3), "raw_mooncake_gbps_1req": round(raw_one_gbps, 3),
        "efficiency_1req": round(conn_one / raw_one_gbps, 3),
        "descriptors_per_request": max(d_one) / 1,
        "descriptors_per_request_32": max(d_all) / sizes.num_requests,
        "handshake_ms": round(handshake * 1e3, 3),
    }
