"""Offline replay of a request trace through the router's real policy and the real block index.

Trace format (one JSON object a line, as `../shared/data/mooncake_synthetic_trace.jsonl`):
`timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per 512-token block;
equal ids at equal positions = equal prefix blocks). Ids become block hashes with
`core.hashing.hash_block`, chained (`h_i = hash_block(h_{i-1}, [id_i])`), so the index sees
the same kind of keys as in production.

Simulated nodes: N nodes, each an LRU cache of C/N blocks. Serving a request touches its
blocks (the first block becomes the most recently used, so a chain is evicted tail first),
inserts the missing ones and evicts beyond capacity; every change is a `core.events`
`BlockStored` / `BlockRemoved` applied to `core.block_index.BlockIndex`. The policy
gets its per-node prefix hits from `BlockIndex.query`, exactly as the router does.

Service-time model: a node serves one request at a time in arrival order (FIFO); a request
occupies it for

    service_s = fixed_s + uncached_input_tokens / prefill_tokens_per_s
                        + output_tokens / decode_tokens_per_s

(defaults 5 ms, 10,000 tok/s, 1,000 tok/s: a prefill-dominated node with batched decode).
The load a node reports at a decision: `queued_prefill_tokens` = its backlog (seconds of work
not yet done) times `prefill_tokens_per_s`, `num_running` = its unfinished requests. Cache
contents change when a request is placed (the node will hold those blocks by the time a later
request could use them: a simplification).

The simulated router keeps the live router's `router.policy.DecayedWork`, on trace time: each
placement charges the node `request_work(uncached, output_length)` (the live router charges
the output as it streams; the trace knows it up front), and every view carries the node's
decayed total as `recent_work`. The policy's default `output_token_weight` (10) is this
model's prefill/decode rate ratio. The least-loaded baseline runs with `work_weight=0`.

Metrics: `hit_ratio` = cached prompt blocks / prompt blocks; `ideal_hit_ratio` = the same
with one infinite cache; `work_imbalance` = max / mean of per-node busy time.

API: `ReplayConfig`, `load_trace`, `replay`, `run(args)`.
"""

from __future__ import annotations

import json
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from pdcluster.core.block_index import BlockIndex
from pdcluster.core.events import BlockRemoved, BlockStored, KVEvent
from pdcluster.core.hashing import hash_block, root_hash
from pdcluster.core.types import BlockHash
from pdcluster.router.load_decay import DecayedWork
from pdcluster.router.policy import NodeView, PolicyConfig, choose_prefill, request_work

TRACE_BLOCK_TOKENS = 512
POLICIES = ("kv", "round-robin", "least-loaded")


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    num_nodes: int = 8
    cache_blocks: int = 100_000
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 1_000.0
    fixed_s: float = 0.005
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.num_nodes}")
        if self.cache_blocks < self.num_nodes:
            raise ValueError("cache-blocks must be at least one block per node")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s) <= 0 or self.fixed_s < 0:
            raise ValueError("service rates must be > 0 and fixed_s >= 0")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    block_hashes: tuple[BlockHash, ...]


def load_trace(path: str | Path) -> list[TraceRequest]:
    memo: dict[tuple[BlockHash, int], BlockHash] = {}
    requests = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
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


class SimNode:
    """An LRU prefix cache and a FIFO server; reports its cache changes as KV events."""

    def __init__(self, node_id: str, capacity: int) -> None:
        self.node_id = node_id
        self.capacity = capacity
        self.cache: OrderedDict[BlockHash, None] = OrderedDict()
        self.busy_until = 0.0
        self.busy_s = 0.0
        self.unfinished: deque[float] = deque()

    def leading_hits(self, block_hashes: tuple[BlockHash, ...]) -> int:
        for i, block_hash in enumerate(block_hashes):
            if block_hash not in self.cache:
                return i
        return len(block_hashes)

    def store(self, block_hashes: tuple[BlockHash, ...]) -> list[KVEvent]:
        new = [h for h in block_hashes if h not in self.cache]
        for block_hash in reversed(block_hashes):  # block 0 ends most recently used
            self.cache[block_hash] = None
            self.cache.move_to_end(block_hash, last=False)
            self.cache.move_to_end(block_hash)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        events: list[KVEvent] = []
        if new:
            events.append(BlockStored(tuple(new), None, TRACE_BLOCK_TOKENS))
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        return events

    def view(self, now: float, cached_blocks: int, rate: float, recent_work: float) -> NodeView:
        while self.unfinished and self.unfinished[0] <= now:
            self.unfinished.popleft()
        backlog = max(0.0, self.busy_until - now)
        return NodeView(self.node_id, "both", cached_blocks, int(backlog * rate),
                        len(self.unfinished), len(self.cache) / self.capacity,
                        recent_work=recent_work)

    def serve(self, now: float, service_s: float) -> None:
        start = max(now, self.busy_until)
        self.busy_until = start + service_s
        self.busy_s += service_s
        self.unfinished.append(self.busy_until)


def apply_events(index: BlockIndex, node_id: str, events: list[KVEvent]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            index.add_blocks(node_id, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.remove_blocks(node_id, event.block_hashes)
        else:
            index.clear_node(node_id)


def _service_s(req: TraceRequest, uncached: int, config: ReplayConfig) -> float:
    return (config.fixed_s + uncached / config.prefill_tokens_per_s
            + req.output_length / config.decode_tokens_per_s)


def replay(requests: list[TraceRequest], policy: str, config: ReplayConfig,
           policy_config: PolicyConfig | None = None) -> dict:
    """Replay with one policy; returns hit_ratio, work_imbalance, decisions per second."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    # the simulated nodes do not pull prefixes from each other: global reuse is off
    pconf = policy_config or PolicyConfig(block_size=TRACE_BLOCK_TOKENS,
                                          global_reuse_min_tokens=0)
    if policy == "least-loaded":
        pconf = PolicyConfig(block_size=pconf.block_size, prefill_weight=0.0, work_weight=0.0,
                             global_reuse_min_tokens=0)
    rng = random.Random(config.seed)
    work = DecayedWork(pconf.work_half_life_s)
    nodes = [SimNode(f"node-{i}", config.cache_blocks // config.num_nodes)
             for i in range(config.num_nodes)]
    index = BlockIndex()
    for node in nodes:
        index.add_node(node.node_id)
    hit_blocks = total_blocks = 0
    decide_s = 0.0
    for i, req in enumerate(requests):
        started = time.perf_counter()
        node = _place(i, req, policy, nodes, index, pconf, config, rng, work)
        decide_s += time.perf_counter() - started
        hits = node.leading_hits(req.block_hashes)
        uncached = max(0, req.input_length - hits * TRACE_BLOCK_TOKENS)
        work.add(node.node_id, request_work(uncached, req.output_length, pconf), req.arrival_s)
        hit_blocks += hits
        total_blocks += len(req.block_hashes)
        node.serve(req.arrival_s, _service_s(req, uncached, config))
        apply_events(index, node.node_id, node.store(req.block_hashes))
    index.check_invariants()
    busy = [n.busy_s for n in nodes]
    return {"hit_ratio": round(hit_blocks / max(total_blocks, 1), 4),
            "work_imbalance": round(max(busy) / (sum(busy) / len(busy)), 4),
            "decision_us": round(decide_s / max(len(requests), 1) * 1e6, 1)}


def _place(i: int, req: TraceRequest, policy: str, nodes: list[SimNode], index: BlockIndex,
           pconf: PolicyConfig, config: ReplayConfig, rng: random.Random,
           work: DecayedWork) -> SimNode:
    if policy == "round-robin":
        return nodes[i % len(nodes)]
    hits = dict(index.query(req.block_hashes)) if policy == "kv" else {}
    recent = work.values(req.arrival_s)
    views = [n.view(req.arrival_s, hits.get(n.node_id, 0), config.prefill_tokens_per_s,
                    recent.get(n.node_id, 0.0)) for n in nodes]
    prompt_tokens = max(req.input_length, 1)
    chosen = choose_prefill(views, prompt_tokens, pconf, rng)
    return nodes[int(chosen.node_id.rsplit("-", 1)[1])]


def ideal_hit_ratio(requests: list[TraceRequest]) -> float:
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


def replay_all(requests: list[TraceRequest], policy: str, config: ReplayConfig) -> dict:
    """The chosen policy and both baselines, in one run, plus the ideal hit ratio."""
    ideal = ideal_hit_ratio(requests)
    result: dict = {"policy": policy, "requests": len(requests), "nodes": config.num_nodes,
                    "cache_blocks": config.cache_blocks, "ideal_hit_ratio": ideal}
    for name in dict.fromkeys((policy, *POLICIES)):
        stats = replay(requests, name, config)
        stats["ideal_hit_ratio"] = ideal
        stats["hit_over_ideal"] = round(stats["hit_ratio"] / ideal, 4) if ideal else None
        result[name] = stats
    result.update({k: result[policy][k] for k in ("hit_ratio", "work_imbalance")})
    return result


def run(args) -> dict:
    """Entry point of `pdcluster replay` (args: trace, nodes, cache_blocks, policy, seed)."""
    started = time.perf_counter()
    requests = load_trace(args.trace)
    config = ReplayConfig(num_nodes=args.nodes, cache_blocks=args.cache_blocks, seed=args.seed)
    result = replay_all(requests, args.policy, config)
    result["wall_s"] = round(time.perf_counter() - started, 2)
    return result
