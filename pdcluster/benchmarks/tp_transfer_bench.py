"""KV transfer between tensor-parallel groups: `pdcluster bench tp-transfer [--json] [--quick]`.

Four engines of the `bench` model (engine.models.tiny_model: 8 layers, 4 KV heads of 64,
float32, 16-token blocks: 256 KiB a block, 16 MiB per 1,024 tokens) in processes of their own,
each with the production connector over Mooncake (TCP on 127.0.0.1) and the CURVE side
channel: prefill nodes at TP=1 and TP=2, decode nodes at TP=1 and TP=2 (each rank of a TP=2
node a process with its own Mooncake engine). The same prompts go P -> D for every pairing,
and the cost of a move is the prefill node's write: from the plan to every rank's last byte
(`WorkerStats.latencies`, "send"; the prefill itself is not counted). Reported, in one run:

- `p2_to_d1_over_p2_to_d2`: TP=2 -> TP=1 (each source rank writes its KV heads into part of
  each block of the one destination: a descriptor per rank and block) over TP=2 -> TP=2 (rank
  to rank, whole blocks, runs of blocks merged);
- `p1_to_d2_over_p1_to_d1`: TP=1 -> TP=2 (one source, two destinations, a descriptor per
  destination rank and block) over TP=1 -> TP=1 (one descriptor per run of blocks);
- each pairing's median milliseconds and descriptors per request, and whether every transfer
  arrived (none recomputed).

On a CPU every process shares the same cores and loopback TCP, so the ratios price the extra
descriptors and the fan-in / fan-out of a heterogeneous move, not NVLink or RDMA.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import tempfile
import time
from dataclasses import dataclass

BLOCK_SIZE = 16
PAIRS = (("p1", "d1"), ("p2", "d2"), ("p2", "d1"), ("p1", "d2"))


@dataclass(frozen=True, slots=True)
class Sizes:
    tokens_per_request: int = 4064  # 254 blocks, within the model's 4,096 positions
    repeats: int = 5


QUICK = Sizes(tokens_per_request=512, repeats=2)


def _node_main(conn, model: str, tp: int, num_blocks: int, secret_text: str) -> None:
    """Child: one engine with the real connector, driven by commands on `conn`."""
    from pdcluster.core.credentials import ClusterSecret
    from pdcluster.core.kv_connector import KVConnector
    from pdcluster.core.kv_transfer import RemoteDecode, RemotePrefill
    from pdcluster.engine import EngineConfig, LLMEngine, SamplingParams
    from pdcluster.transfer.connector_scheduler import ConnectorScheduler
    from pdcluster.transfer.connector_worker import ConnectorWorker
    from pdcluster.transfer.transport import MooncakeTransport

    transport = MooncakeTransport(curve=ClusterSecret.from_text(secret_text).curve_keys())
    worker = ConnectorWorker(transport, timeout_s=120)
    engine = LLMEngine(EngineConfig(model, device="cpu", dtype="float32",
                                    block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                                    tensor_parallel_size=tp),
                       KVConnector(ConnectorScheduler(), worker))
    conn.send(transport.reply_address)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    waiting = False
    while True:
        if conn.poll():
            cmd, *args = conn.recv()
            if cmd == "add":
                rid, prompt, tid, source = args
                transfer = RemotePrefill(tid, source) if source else RemoteDecode(tid)
                engine.add_request(rid, prompt, params, kv_transfer=transfer)
            elif cmd == "wait_idle":
                waiting = True
            elif cmd == "sends":
                conn.send([t.seconds for t in worker.take_latencies() if t.kind == "send"])
            elif cmd == "stats":
                conn.send(worker.counters())
            elif cmd == "stop":
                engine.close()
                conn.send("stopped")
                return
        if engine.has_unfinished_requests() or engine.has_pinned_blocks():
            engine.step()
        elif waiting:
            waiting = False
            conn.send("idle")
        else:
            time.sleep(0.001)


class _Node:
    def __init__(self, ctx, model: str, tp: int, num_blocks: int, secret_text: str) -> None:
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_node_main, args=(child, model, tp, num_blocks,
                                                            secret_text))
        self.process.start()

    def ready(self) -> None:
        if not self.conn.poll(600):
            raise TimeoutError("a benchmark node did not start")
        self.address = self.conn.recv()

    def call(self, *cmd, timeout_s: float = 600.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"a benchmark node did not answer {cmd[0]}")
        return self.conn.recv()

    def stop(self) -> None:
        if self.process.is_alive():
            self.call("stop", timeout_s=60)
        self.process.join(30)


def _move(nodes: dict, pair: tuple[str, str], prompt: list[int], n: int) -> None:
    """One request P -> D; both idle afterwards."""
    p, d = nodes[pair[0]], nodes[pair[1]]
    tid = f"t{n}"
    d.conn.send(("add", f"d{n}", prompt, tid, p.address))
    p.conn.send(("add", f"p{n}", prompt, tid, None))
    for node in (d, p):
        if node.call("wait_idle") != "idle":
            raise RuntimeError("a benchmark node did not go idle")


def _measure(nodes: dict, sizes: Sizes) -> dict:
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(3, 32000) for _ in range(n)]  # noqa: E731
    ids = iter(range(10**9))
    for pair in PAIRS:  # warm-up: each pair of Mooncake engines connects once
        _move(nodes, pair, prompt(2 * BLOCK_SIZE), next(ids))
    before = {name: node.call("stats") for name, node in nodes.items()}
    for node in nodes.values():
        node.call("sends")
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in PAIRS}
    descriptors: dict[tuple[str, str], int] = {pair: 0 for pair in PAIRS}
    nbytes: dict[tuple[str, str], int] = {pair: 0 for pair in PAIRS}
    for _ in range(sizes.repeats):
        for pair in PAIRS:  # interleaved: a drift of the machine hits every pairing alike
            start = nodes[pair[0]].call("stats")
            _move(nodes, pair, prompt(sizes.tokens_per_request), next(ids))
            times[pair] += nodes[pair[0]].call("sends")
            end = nodes[pair[0]].call("stats")
            descriptors[pair] = end["descriptors_sent"] - start["descriptors_sent"]
            nbytes[pair] = end["bytes_sent"] - start["bytes_sent"]
    after = {name: node.call("stats") for name, node in nodes.items()}
    recvs_ok = sum(after[d]["recvs_ok"] - before[d]["recvs_ok"] for d in ("d1", "d2"))
    ms = {pair: statistics.median(t) * 1e3 for pair, t in times.items()}
    result: dict = {"tokens_per_request": sizes.tokens_per_request, "repeats": sizes.repeats,
                    "all_transferred": recvs_ok == sizes.repeats * len(PAIRS)
                    and len(set(nbytes.values())) == 1,
                    "bytes_per_request": nbytes[PAIRS[0]]}
    for (p, d), value in ms.items():
        result[f"{p}_to_{d}_ms"] = round(value, 3)
        result[f"{p}_to_{d}_descriptors"] = descriptors[(p, d)]
    result["p2_to_d1_over_p2_to_d2"] = round(ms[("p2", "d1")] / ms[("p2", "d2")], 3)
    result["p1_to_d2_over_p1_to_d1"] = round(ms[("p1", "d2")] / ms[("p1", "d1")], 3)
    return result


def run(args: argparse.Namespace) -> dict:
    from pdcluster.core.credentials import ClusterSecret
    from pdcluster.engine.models.tiny_model import make_tiny_model

    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    num_blocks = 2 * sizes.tokens_per_request // BLOCK_SIZE + 8
    secret = ClusterSecret.generate().to_text()  # the side channel speaks CURVE, as in a cluster
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="pdcluster-tp-transfer-") as tmp:
        model = str(make_tiny_model(tmp, arch="llama", seed=0, preset="bench"))
        nodes = {name: _Node(ctx, model, int(name[1]), num_blocks, secret)
                 for name in ("p1", "p2", "d1", "d2")}
        try:
            for node in nodes.values():
                node.ready()
            return _measure(nodes, sizes)
        finally:
            for node in nodes.values():
                node.stop()
