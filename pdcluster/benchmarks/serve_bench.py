"""Serving benchmark: `pdcluster bench serve [--json] [--quick]`.

A local cluster on Ray — one prefill and one decode node actor, the metadata service — with
the `bench` preset model (hidden 512, 8 layers, float32, CPU). Requests go to the nodes over
the node protocol, exactly as the router sends them, so the figures are the nodes' and the
KV transfer's, without HTTP:

- TTFT of 2,048-token prompts, disaggregated (P prefills, KV moves to D, D streams) against
  colocated (the same decode node prefills and decodes by itself) — same cluster, same run,
  fresh random prompts each time so no prefix cache helps either side;
- `kv_transfer_ms_p50`: the prefill node's data-plane write of those prompts' KV, and its
  share of the disaggregated TTFT;
- `itl_p50_ms` and `output_tokens_per_s` over a batch of concurrent disaggregated requests.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Sizes:
    ttft_prompt_len: int = 2048
    ttft_repeats: int = 5
    batch_requests: int = 8
    batch_prompt_len: int = 256
    batch_output_len: int = 64


QUICK = Sizes(ttft_prompt_len=512, ttft_repeats=2, batch_requests=4, batch_prompt_len=64,
              batch_output_len=16)


def run(args: argparse.Namespace) -> dict:
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.ray_cluster import RayCluster
    from pdcluster.engine.models.tiny_model import make_tiny_model

    sizes = QUICK if getattr(args, "quick", False) else Sizes()
    with tempfile.TemporaryDirectory(prefix="pdcluster-serve-bench-") as tmp:
        model = str(make_tiny_model(tmp, preset="bench"))
        cluster = RayCluster(ClusterConfig(model=model, num_prefill=1, num_decode=1,
                                           engine={"max_num_batched_tokens": 2048})).start()
        try:
            return {**asdict(sizes), **_Bench(cluster, sizes).measure()}
        finally:
            cluster.stop()


class _Bench:
    def __init__(self, cluster, sizes: Sizes) -> None:
        self.cluster, self.sizes = cluster, sizes
        nodes = {info["role"]: info for info in cluster.nodes()}
        self.prefill, self.decode = nodes["prefill"], nodes["decode"]
        clients = cluster.router_clients()  # as a registered router: nodes admit no other
        self.to_p = clients[self.prefill["node_id"]]
        self.to_d = clients[self.decode["node_id"]]
        self.rng = random.Random(0)
        self.ids = itertools.count()

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(3, 32000) for _ in range(n)]

    def send(self, prompt: list[int], max_tokens: int, disaggregated: bool) -> str:
        from pdcluster.core.node_wire import GenerateRequest, SamplingSpec, TransferSpec

        n = next(self.ids)
        rid, tid = f"b{n}", f"bt{n}"
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        transfer = None
        if disaggregated:
            transfer = TransferSpec("remote_prefill", tid, self.prefill["kv_address"])
            self.to_p.send(GenerateRequest(f"p{n}", prompt,
                                           SamplingSpec(max_tokens=1, temperature=0.0),
                                           TransferSpec("remote_decode", tid)))
        self.to_d.send(GenerateRequest(rid, prompt, spec, transfer))
        return rid

    def ttft(self, disaggregated: bool) -> float:
        """Seconds from sending a request to its first token on the decode node."""
        from pdcluster.core.node_wire import TokenDelta

        start = time.perf_counter()
        rid = self.send(self.prompt(self.sizes.ttft_prompt_len), 2, disaggregated)
        first = self.to_d.recv(600)
        elapsed = time.perf_counter() - start
        if not isinstance(first, TokenDelta):
            raise RuntimeError(f"request failed: {first}")
        if not first.finished:
            self.to_d.collect({rid})
        if disaggregated:
            self.to_p.collect({f"p{rid[1:]}"})
        return elapsed

    def measure(self) -> dict:
        import ray

        self.ttft(True), self.ttft(False)  # warm-up: connections, code paths
        disagg, colocated = [], []
        for _ in range(self.sizes.ttft_repeats):
            disagg.append(self.ttft(True))
            colocated.append(self.ttft(False))
        stats = ray.get(self.cluster.actors["p0"].transfer_stats.remote())
        writes = stats["recent_write_s"][-self.sizes.ttft_repeats:]
        itl, tps = self.batch()
        t_disagg, t_colo = statistics.median(disagg), statistics.median(colocated)
        transfer = statistics.median(writes)
        return {"ttft_p50_ms_disagg": round(t_disagg * 1e3, 1),
                "ttft_p50_ms_colocated": round(t_colo * 1e3, 1),
                "ttft_ratio_disagg_vs_colocated": round(t_disagg / t_colo, 3),
                "kv_transfer_ms_p50": round(transfer * 1e3, 2),
                "transfer_share_of_ttft": round(transfer / t_disagg, 4),
                "itl_p50_ms": round(itl * 1e3, 2), "output_tokens_per_s": round(tps, 1)}

    def batch(self) -> tuple[float, float]:
        """Concurrent disaggregated requests: median inter-token gap and output tokens/s."""
        from pdcluster.core.node_wire import RequestError, TokenDelta

        s = self.sizes
        start = time.perf_counter()
        rids = {self.send(self.prompt(s.batch_prompt_len), s.batch_output_len, True)
                for _ in range(s.batch_requests)}
        last: dict[str, float] = {}
        gaps, tokens = [], 0
        open_ids = set(rids)
        while open_ids:
            msg = self.to_d.recv(600)
            if not isinstance(msg, TokenDelta | RequestError):
                raise RuntimeError(f"the decode node sent a {type(msg).__name__}")
            now = time.perf_counter()
            if msg.request_id in last:
                gaps.append(now - last[msg.request_id])
            last[msg.request_id] = now
            if isinstance(msg, TokenDelta):
                tokens += len(msg.token_ids)
            if isinstance(msg, RequestError) or msg.finished:
                open_ids.discard(msg.request_id)
        elapsed = time.perf_counter() - start
        self.to_p.collect({f"p{r[1:]}" for r in rids})
        return statistics.median(gaps), tokens / elapsed
