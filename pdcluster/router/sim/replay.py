"""Offline replay of a request trace through the router's real policy and the real block index.

Trace format (one JSON object a line, as the Mooncake trace in
`tests/data/mooncake_synthetic_trace.jsonl`, or the rows of a `router.sim.trace_gen` generator):
`timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per 512-token block; equal
ids at equal positions = equal prefix blocks). Ids become block hashes with
`core.hashing.hash_block`, chained (`h_i = hash_block(h_{i-1}, [id_i])`), so the index sees the
same kind of keys as in production (and an id after a different prefix is a different block, as
in a prefix cache).

Simulated nodes (`router.sim.sim_nodes`): N nodes, each a device LRU cache of
`device_blocks` blocks (C/N by default) over a host tier of `host_blocks` (none by default)
and a FIFO server; every cache change is a `core.events` event (`BlockStored`,
`BlockMoved` for a demotion to the host, `BlockRemoved`) applied to
`core.block_index.BlockIndex`, and the policy gets its per-node prefix hits, and how many of
them sit on the host, from `BlockIndex.query` and `BlockIndex.lower_tiers`, exactly as the
router does. A node reports the costs it would measure (`TierCosts`: its prefill rate, the
host's and the network's bandwidth and latency) with its view, and the policy prices a host
load and a pull from them. Cache contents change when a request is
placed (the node will hold those blocks by the time a later request could use them: a
simplification).

Global prefix reuse (on by default, as in the live cluster): the policy prices a pull and
names the holder exactly as `router.routing.policy.route` does for the live router
(`policy.pull_source`); the chosen node then applies the live node's rule
(`sim_nodes.node_pull_blocks`: pull the full blocks past its own hit when there are at least
`min_pull_blocks`). A pull costs `pull_latency_s + blocks * 512 * kv_bytes_per_token /
pull_bytes_per_s` of waiting (not of node compute); the holder's pulled blocks are touched
(its LRU), on whichever tier they are: a peer's host tier serves pulls too (the global pool).
A load of `h` blocks from the node's own host costs `host_latency_s + h * block_bytes /
host_bytes_per_s` of waiting. Pulled blocks are counted apart from local hits. The
round-robin and least-loaded baselines never pull (they do not consult the index);
`round-robin-pool` places in turn and then pulls whatever the index says another node holds
past its own hit (any router over a shared KV pool: vLLM with a KV store, no KV-aware
routing).

The simulated router keeps the live router's `DecayedWork`, on trace time: each placement
charges the node `request_work(computed, output_length)` (computed = prompt tokens neither
held nor pulled; the live router charges the output as it streams, the trace knows it up
front), and every view carries the node's decayed total as `recent_work`.

Metrics: `hit_ratio` = locally cached prompt blocks / prompt blocks (`host_hit_ratio`: the
part loaded from the host tier); `pulled_ratio` = pulled blocks / prompt blocks;
`reuse_ratio` = their sum; `ideal_hit_ratio` = the hit ratio of one infinite cache (what any
placement could at best reuse, local or pulled); `achievable_hit_ratio` = that of one LRU
cache as large as all nodes' tiers together (the bound for finite memory; `*_over_achievable`
read against it); `ttft_bound_p50_s` / `ttft_bound_p90_s` = the TTFT percentiles with no
queue and the infinite cache's reuse for free (router.sim.bounds: no policy goes below);
`ttft_p90_over` = the policy's TTFT p90 over each baseline's; `work_imbalance` =
max / mean of per-node busy time; `utilization` =
busy time / (nodes x the trace's span); `ttft_p50_s` / `ttft_p90_s` = queueing + pull + prefill;
`unattested_claims` = the claimed blocks no router placement vouched for
(router.routing.attestations; 0 on an honest trace).

API: `ReplayConfig`, `parse_trace`, `load_trace`, `replay`, `replay_all`, `ideal_hit_ratio`,
`achievable_hit_ratio` (router.sim.bounds), `run(args)`.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from pdcluster.router.routing.policy import PolicyConfig
from pdcluster.router.sim import trace_gen
from pdcluster.router.sim.bounds import achievable_hit_ratio, ideal_hit_ratio, ideal_ttfts
from pdcluster.router.sim.replay_config import ReplayConfig, TraceRequest, load_trace, parse_trace
from pdcluster.router.sim.sim_cluster import POLICIES, SimCluster, place, policy_config_for
from pdcluster.router.sim.sim_nodes import TRACE_BLOCK_TOKENS

__all__ = ["POLICIES", "ReplayConfig", "TraceRequest", "achievable_hit_ratio", "ideal_hit_ratio",
           "load_trace", "parse_trace", "replay", "replay_all", "replay_config", "run",
           "trace_rows"]


@dataclass(slots=True)
class _Tally:
    hit_blocks: int = 0
    host_blocks: int = 0
    pulled_blocks: int = 0
    total_blocks: int = 0
    pulls: int = 0
    decide_s: float = 0.0

    def ratios(self) -> dict:
        total = max(self.total_blocks, 1)
        return {"hit_ratio": round(self.hit_blocks / total, 4),
                "host_hit_ratio": round(self.host_blocks / total, 4),
                "pulled_ratio": round(self.pulled_blocks / total, 4),
                "reuse_ratio": round((self.hit_blocks + self.pulled_blocks) / total, 4),
                "pulls": self.pulls, "pulled_blocks": self.pulled_blocks}


def replay(requests: list[TraceRequest], policy: str, config: ReplayConfig,
           policy_config: PolicyConfig | None = None) -> dict:
    """Replay with one policy: hit / host / pulled / reuse ratios, work_imbalance, TTFT,
    decision time."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    cluster = SimCluster(config, policy_config_for(policy, policy_config, config))
    rng, tally, ttfts = random.Random(config.seed), _Tally(), []
    for i, req in enumerate(requests):
        started = time.perf_counter()
        placed = place(cluster, req, i, policy, rng)
        tally.decide_s += time.perf_counter() - started
        tally.hit_blocks += placed.hits
        tally.host_blocks += placed.host
        tally.pulled_blocks += placed.pulled
        tally.pulls += placed.pulled > 0
        tally.total_blocks += len(req.block_hashes)
        ttfts.append(cluster.serve(req, placed))
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
            "decision_us": round(tally.decide_s / max(len(requests), 1) * 1e6, 1),
            "unattested_claims": sum(cluster.attestations.unattested_claims.values())}


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def replay_all(requests: list[TraceRequest], policy: str, config: ReplayConfig,
               policy_config: PolicyConfig | None = None) -> dict:
    """The chosen policy and the baselines, in one run, plus the ideal hit ratio (infinite
    memory) and the achievable one (one LRU cache of the cluster's memory)."""
    ideal = ideal_hit_ratio(requests)
    capacity = config.num_nodes * (config.node_blocks + config.host_blocks)
    achievable = achievable_hit_ratio(requests, capacity)
    result: dict = {"policy": policy, "requests": len(requests), "nodes": config.num_nodes,
                    "cache_blocks": config.cache_blocks, "device_blocks": config.node_blocks,
                    "host_blocks": config.host_blocks, "global_reuse": config.global_reuse,
                    "ideal_hit_ratio": ideal, "achievable_hit_ratio": achievable}
    for name in dict.fromkeys((policy, *POLICIES)):
        stats = replay(requests, name, config, policy_config)
        stats["ideal_hit_ratio"] = ideal
        for key in ("hit", "reuse"):
            stats[f"{key}_over_ideal"] = round(stats[f"{key}_ratio"] / ideal, 4) if ideal \
                else None
        stats["reuse_over_achievable"] = (round(stats["reuse_ratio"] / achievable, 4)
                                          if achievable else None)
        result[name] = stats
    result.update({k: result[policy][k] for k in
                   ("hit_ratio", "host_hit_ratio", "pulled_ratio", "reuse_ratio",
                    "work_imbalance")})
    bound = ideal_ttfts(requests, config.fixed_s, config.prefill_tokens_per_s,
                        TRACE_BLOCK_TOKENS)
    result["ttft_bound_p50_s"] = round(_quantile(bound, 0.5), 4)
    result["ttft_bound_p90_s"] = round(_quantile(bound, 0.9), 4)
    result["ttft_p90_over"] = {name: round(result[policy]["ttft_p90_s"]
                                           / result[name]["ttft_p90_s"], 4)
                               for name in POLICIES if name != policy
                               and result[name]["ttft_p90_s"] > 0}
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
    cache_blocks, device_blocks, host_blocks, policy, no_global_reuse, pull_gbps,
    pull_latency_ms, host_gbps, host_latency_ms, kv_bytes_per_token; with `planner`, the
    planner's replay instead: router.sim.planner_replay)."""
    if getattr(args, "planner", False):
        from pdcluster.router.sim import planner_replay

        result = planner_replay.run(args, trace_rows(args))
        result["trace"] = args.synthetic or str(args.trace)
        return result
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
                        pull_latency_s=args.pull_latency_ms / 1000.0,
                        device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                        host_bytes_per_s=args.host_gbps * 1e9,
                        host_latency_s=args.host_latency_ms / 1000.0)
