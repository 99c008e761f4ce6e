"""Offline replay of a request trace through the router's real policy and the real block index.

Trace format (one JSON object a line, as `../shared/data/mooncake_synthetic_trace.jsonl`, or
the rows of a `router.sim.trace_gen` generator): `timestamp` (ms), `input_length`,
`output_length`, `hash_ids` (one id per 512-token block; equal ids at equal positions = equal
prefix blocks). Ids become block hashes with `core.hashing.hash_block`, chained
(`h_i = hash_block(h_{i-1}, [id_i])`), so the index sees the same kind of keys as in
production (and an id after a different prefix is a different block, as in a prefix cache).

Simulated nodes (`router.sim.sim_nodes`): N nodes, each an LRU cache of C/N blocks and a FIFO
server; every cache change is a `core.events` `BlockStored` / `BlockRemoved` applied to
`core.block_index.BlockIndex`, and the policy gets its per-node prefix hits from
`BlockIndex.query`, exactly as the router does. Cache contents change when a request is
placed (the node will hold those blocks by the time a later request could use them: a
simplification).

Global prefix reuse (on by default, as in the live cluster): the policy prices a pull and
names the holder exactly as `router.routing.policy.route` does for the live router
(`policy.pull_source`); the chosen node then applies the live node's rule
(`sim_nodes.node_pull_blocks`: pull the full blocks past its own hit when there are at least
`min_pull_blocks`). A pull costs `pull_latency_s + blocks * 512 * kv_bytes_per_token /
pull_bytes_per_s` of waiting (not of node compute); the holder's pulled blocks are touched
(its LRU). Pulled blocks are counted apart from local hits. The round-robin and least-loaded
baselines never pull (they do not consult the index).

The simulated router keeps the live router's `DecayedWork`, on trace time: each placement
charges the node `request_work(computed, output_length)` (computed = prompt tokens neither
held nor pulled; the live router charges the output as it streams, the trace knows it up
front), and every view carries the node's decayed total as `recent_work`.

Metrics: `hit_ratio` = locally cached prompt blocks / prompt blocks; `pulled_ratio` = pulled
blocks / prompt blocks; `reuse_ratio` = their sum; `ideal_hit_ratio` = the hit ratio of one
infinite cache (what any placement could at best reuse, local or pulled); `work_imbalance` =
max / mean of per-node busy time; `utilization` =
busy time / (nodes x the trace's span); `ttft_p50_s` / `ttft_p90_s` = queueing + pull + prefill.

API: `ReplayConfig`, `parse_trace`, `load_trace`, `replay`, `replay_all`, `ideal_hit_ratio`,
`run(args)`.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pdcluster.core.block_index import BlockIndex
from pdcluster.core.hashing import hash_block, root_hash
from pdcluster.core.types import BlockHash
from pdcluster.router.routing.load_decay import DecayedWork
from pdcluster.router.routing.policy import PolicyConfig, choose_prefill, pull_source, request_work
from pdcluster.router.sim import trace_gen
from pdcluster.router.sim.sim_nodes import (
    TRACE_BLOCK_TOKENS,
    SimNode,
    apply_events,
    node_pull_blocks,
)

POLICIES = ("kv", "round-robin", "least-loaded")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    num_nodes: int = 8
    cache_blocks: int = 100_000
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 1_000.0
    fixed_s: float = 0.005
    seed: int = 0
    global_reuse: bool = True
    kv_bytes_per_token: int = 131_072  # an 8B GQA model in fp16 (32 layers x 8 x 128 x K,V)
    pull_bytes_per_s: float = 25e9  # a 200 Gb/s RDMA link
    pull_latency_s: float = 0.002  # side-channel round trip + transfer set-up, per pull
    min_pull_blocks: int = 1  # trace blocks (512 tokens): the node's threshold

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.num_nodes}")
        if self.cache_blocks < self.num_nodes:
            raise ValueError("cache-blocks must be at least one block per node")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s) <= 0 or self.fixed_s < 0:
            raise ValueError("service rates must be > 0 and fixed_s >= 0")
        if self.pull_bytes_per_s <= 0 or self.pull_latency_s < 0 or self.kv_bytes_per_token < 1:
            raise ValueError("pull bandwidth and KV bytes per token must be > 0, latency >= 0")
        if self.min_pull_blocks < 1:
            raise ValueError(f"min_pull_blocks must be >= 1, got {self.min_pull_blocks}")

    def pull_s(self, num_blocks: int) -> float:
        """How long a request waits for `num_blocks` pulled blocks."""
        block_bytes = TRACE_BLOCK_TOKENS * self.kv_bytes_per_token
        return self.pull_latency_s + num_blocks * block_bytes / self.pull_bytes_per_s


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    block_hashes: tuple[BlockHash, ...]


def parse_trace(rows: list[dict]) -> list[TraceRequest]:
    """Trace rows -> requests with chained block hashes."""
    memo: dict[tuple[BlockHash, int], BlockHash] = {}
    requests = []
    for row in rows:
        parent, hashes = root_hash(), []
        for hash_id in row["hash_ids"]:
            key = (parent, hash_id)
            if key not in memo:
                memo[key] = hash_block(parent, [hash_id])
            parent = memo[key]
            hashes.append(parent)
        requests.append(TraceRequest(row["timestamp"] / 1000.0, int(row["input_length"]),
                                     int(row["output_length"]), tuple(hashes)))
    return requests


def load_trace(path: str | Path) -> list[TraceRequest]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return parse_trace([json.loads(line) for line in lines if line.strip()])


@dataclass(slots=True)
class _Tally:
    hit_blocks: int = 0
    pulled_blocks: int = 0
    total_blocks: int = 0
    pulls: int = 0
    decide_s: float = 0.0

    def ratios(self) -> dict:
        total = max(self.total_blocks, 1)
        return {"hit_ratio": round(self.hit_blocks / total, 4),
                "pulled_ratio": round(self.pulled_blocks / total, 4),
                "reuse_ratio": round((self.hit_blocks + self.pulled_blocks) / total, 4),
                "pulls": self.pulls, "pulled_blocks": self.pulled_blocks}


class _Cluster:
    """The simulated nodes, the index they feed and the router's decayed work."""

    def __init__(self, config: ReplayConfig, pconf: PolicyConfig) -> None:
        self.config, self.pconf = config, pconf
        self.nodes = [SimNode(f"node-{i}", config.cache_blocks // config.num_nodes)
                      for i in range(config.num_nodes)]
        self.by_id = {node.node_id: node for node in self.nodes}
        self.index = BlockIndex()
        for node in self.nodes:
            self.index.add_node(node.node_id)
        self.work = DecayedWork(pconf.work_half_life_s)

    def views(self, req: TraceRequest, prefix_aware: bool) -> list:
        hits = dict(self.index.query(req.block_hashes)) if prefix_aware else {}
        recent = self.work.values(req.arrival_s)
        return [n.view(req.arrival_s, hits.get(n.node_id, 0), self.config.prefill_tokens_per_s,
                       recent.get(n.node_id, 0.0)) for n in self.nodes]

    def pull(self, req: TraceRequest, views: list, chosen, hits: int) -> int:
        """Blocks the chosen node pulls (the policy names the holder, the node decides)."""
        source_id, source_blocks = pull_source(views, chosen, max(req.input_length, 1),
                                               self.pconf)
        if source_id is None:
            return 0
        pulled = node_pull_blocks(source_blocks, req.input_length // TRACE_BLOCK_TOKENS, hits,
                                  self.config.min_pull_blocks)
        if pulled:
            holder = self.by_id[source_id]
            apply_events(self.index, source_id, holder.store(req.block_hashes[:hits + pulled]))
        return pulled

    def serve(self, node: SimNode, req: TraceRequest, hits: int, pulled: int) -> float:
        """Charge, queue and cache one request on `node`; returns its TTFT."""
        config = self.config
        computed = max(0, req.input_length - (hits + pulled) * TRACE_BLOCK_TOKENS)
        self.work.add(node.node_id, request_work(computed, req.output_length, self.pconf),
                      req.arrival_s)
        prefill_s = config.fixed_s + computed / config.prefill_tokens_per_s
        ready = req.arrival_s + (config.pull_s(pulled) if pulled else 0.0)
        start = node.serve(ready, prefill_s + req.output_length / config.decode_tokens_per_s,
                           len(req.block_hashes))
        apply_events(self.index, node.node_id, node.store(req.block_hashes))
        return start + prefill_s - req.arrival_s


def _policy_config(policy: str, policy_config: PolicyConfig | None,
                   config: ReplayConfig) -> PolicyConfig:
    pconf = policy_config or PolicyConfig(block_size=TRACE_BLOCK_TOKENS)
    if not config.global_reuse:
        pconf = replace(pconf, global_reuse_min_tokens=0)
    if policy == "least-loaded":
        pconf = pconf.load_only()
    return pconf


def replay(requests: list[TraceRequest], policy: str, config: ReplayConfig,
           policy_config: PolicyConfig | None = None) -> dict:
    """Replay with one policy: hit / pulled / reuse ratios, work_imbalance, TTFT, decision
    time."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    cluster = _Cluster(config, _policy_config(policy, policy_config, config))
    rng, tally, ttfts = random.Random(config.seed), _Tally(), []
    for i, req in enumerate(requests):
        started = time.perf_counter()
        if policy == "round-robin":
            node, pulled = cluster.nodes[i % len(cluster.nodes)], 0
            hits = node.leading_hits(req.block_hashes)
        else:
            views = cluster.views(req, prefix_aware=policy == "kv")
            chosen = choose_prefill(views, max(req.input_length, 1), cluster.pconf, rng)
            node = cluster.by_id[chosen.node_id]
            hits = node.leading_hits(req.block_hashes)
            pulled = cluster.pull(req, views, chosen, hits) if policy == "kv" else 0
        tally.decide_s += time.perf_counter() - started
        tally.hit_blocks += hits
        tally.pulled_blocks += pulled
        tally.pulls += pulled > 0
        tally.total_blocks += len(req.block_hashes)
        ttfts.append(cluster.serve(node, req, hits, pulled))
    cluster.index.check_invariants()
    busy = [n.busy_s for n in cluster.nodes]
    span_s = max(max(n.busy_until for n in cluster.nodes) - requests[0].arrival_s, 1e-9) \
        if requests else 1.0
    ttfts.sort()
    return {**tally.ratios(),
            "work_imbalance": round(max(busy) / max(sum(busy) / len(busy), 1e-12), 4),
            "utilization": round(sum(busy) / (len(busy) * span_s), 4),
            "ttft_p50_s": round(_quantile(ttfts, 0.5), 4),
            "ttft_p90_s": round(_quantile(ttfts, 0.9), 4),
            "decision_us": round(tally.decide_s / max(len(requests), 1) * 1e6, 1)}


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def ideal_hit_ratio(requests: list[TraceRequest]) -> float:
    """The hit ratio of one infinite cache: a block hits when its whole prefix was seen."""
    seen: set[BlockHash] = set()
    hit_blocks = total_blocks = 0
    for req in requests:
        for block_hash in req.block_hashes:
            if block_hash not in seen:
                break
            hit_blocks += 1
        total_blocks += len(req.block_hashes)
        seen.update(req.block_hashes)
    return round(hit_blocks / max(total_blocks, 1), 4)


def replay_all(requests: list[TraceRequest], policy: str, config: ReplayConfig,
               policy_config: PolicyConfig | None = None) -> dict:
    """The chosen policy and both baselines, in one run, plus the ideal hit ratio."""
    ideal = ideal_hit_ratio(requests)
    result: dict = {"policy": policy, "requests": len(requests), "nodes": config.num_nodes,
                    "cache_blocks": config.cache_blocks, "global_reuse": config.global_reuse,
                    "ideal_hit_ratio": ideal}
    for name in dict.fromkeys((policy, *POLICIES)):
        stats = replay(requests, name, config, policy_config)
        stats["ideal_hit_ratio"] = ideal
        for key in ("hit", "reuse"):
            stats[f"{key}_over_ideal"] = round(stats[f"{key}_ratio"] / ideal, 4) if ideal \
                else None
        result[name] = stats
    result.update({k: result[policy][k] for k in
                   ("hit_ratio", "pulled_ratio", "reuse_ratio", "work_imbalance")})
    return result


def trace_rows(args) -> list[dict]:
    """The rows `args` names: a trace file (`args.trace`) or a synthetic generator
    (`args.synthetic`, with `args.seed` and `args.scale`)."""
    if args.synthetic:
        return trace_gen.generate(args.synthetic, args.seed, args.scale)
    lines = Path(args.trace).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def run(args) -> dict:
    """Entry point of `pdcluster replay` (args: trace | synthetic, seed, scale, nodes,
    cache_blocks, policy, no_global_reuse, pull_gbps, pull_latency_ms, kv_bytes_per_token)."""
    started = time.perf_counter()
    requests = parse_trace(trace_rows(args))
    result = replay_all(requests, args.policy, replay_config(args))
    result["trace"] = args.synthetic or str(args.trace)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    return result


def replay_config(args) -> ReplayConfig:
    """The `ReplayConfig` of parsed `pdcluster replay` arguments (ValueError if invalid)."""
    return ReplayConfig(num_nodes=args.nodes, cache_blocks=args.cache_blocks, seed=args.seed,
                        global_reuse=not args.no_global_reuse,
                        kv_bytes_per_token=args.kv_bytes_per_token,
                        pull_bytes_per_s=args.pull_gbps * 1e9,
                        pull_latency_s=args.pull_latency_ms / 1000.0)
