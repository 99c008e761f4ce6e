"""What `pdcluster replay` replays and how: `ReplayConfig` (the simulated cluster: nodes, their
tiers, service rates, the network) and the trace as `TraceRequest`s with chained block hashes.

Trace format (one JSON object a line, as the Mooncake trace in
`tests/data/mooncake_synthetic_trace.jsonl`, or the rows of a `router.sim.trace_gen` generator):
`timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one id per 512-token block; equal
ids at equal positions = equal prefix blocks). Ids become block hashes with
`core.hashing.hash_block`, chained (`h_i = hash_block(h_{i-1}, [id_i])`).

API: `ReplayConfig`, `TraceRequest`, `parse_trace`, `load_trace`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pdcluster.core.hashing import hash_block, root_hash
from pdcluster.core.types import BlockHash
from pdcluster.router.routing.tier_costs import TierCosts
from pdcluster.router.sim.sim_nodes import TRACE_BLOCK_TOKENS


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
    device_blocks: int | None = None  # per node; None: cache_blocks / num_nodes
    host_blocks: int = 0  # per node: the host tier below the device (0: none)
    # router replicas, each attesting only what it placed; request i goes to router i % routers
    # (a load balancer without affinity)
    routers: int = 1
    host_bytes_per_s: float = 40e9  # host -> device over PCIe 5 x16, pinned memory
    host_latency_s: float = 0.0002  # per load: the copy's set-up

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {self.num_nodes}")
        if self.cache_blocks < self.num_nodes:
            raise ValueError("cache-blocks must be at least one block per node")
        if self.device_blocks is not None and self.device_blocks < 1:
            raise ValueError(f"device-blocks must be >= 1, got {self.device_blocks}")
        if self.host_blocks < 0:
            raise ValueError(f"host-blocks must be >= 0, got {self.host_blocks}")
        if self.host_bytes_per_s <= 0 or self.host_latency_s < 0:
            raise ValueError("host bandwidth must be > 0 and its latency >= 0")
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s) <= 0 or self.fixed_s < 0:
            raise ValueError("service rates must be > 0 and fixed_s >= 0")
        if self.pull_bytes_per_s <= 0 or self.pull_latency_s < 0 or self.kv_bytes_per_token < 1:
            raise ValueError("pull bandwidth and KV bytes per token must be > 0, latency >= 0")
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        if self.min_pull_blocks < 1:
            raise ValueError(f"min_pull_blocks must be >= 1, got {self.min_pull_blocks}")

    @property
    def node_blocks(self) -> int:
        """Device blocks per node."""
        return self.device_blocks or self.cache_blocks // self.num_nodes

    def pull_s(self, num_blocks: int) -> float:
        """How long a request waits for `num_blocks` pulled blocks."""
        block_bytes = TRACE_BLOCK_TOKENS * self.kv_bytes_per_token
        return self.pull_latency_s + num_blocks * block_bytes / self.pull_bytes_per_s

    def host_s(self, num_blocks: int) -> float:
        """How long a request waits for `num_blocks` blocks loaded from its node's host."""
        block_bytes = TRACE_BLOCK_TOKENS * self.kv_bytes_per_token
        return self.host_latency_s + num_blocks * block_bytes / self.host_bytes_per_s

    def tier_costs(self) -> TierCosts:
        """What a simulated node reports it measured: its rate and the copies' figures."""
        return TierCosts(self.prefill_tokens_per_s, self.kv_bytes_per_token,
                         self.host_bytes_per_s if self.host_blocks else 0.0,
                         self.host_latency_s, pull_bytes_per_s=self.pull_bytes_per_s,
                         pull_latency_s=self.pull_latency_s)


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
