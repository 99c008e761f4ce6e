"""The prices of KV that a node does not hold on its device, for the routing policy
(`router.routing.policy`): loading its own blocks back from its host memory or disk, and
pulling blocks from a peer. All in prefill-token equivalents, the policy's unit.

Each node measures what it costs (`TierCosts`: a tier's bandwidth and fixed latency per
load, its KV bytes per token and its prefill rate) and reports it with its load; a load of
`tokens` then costs

    (latency_s + tokens * kv_bytes_per_token / bytes_per_s) * prefill_tokens_per_s

prompt tokens: the tokens the node would have prefilled in that time. A node that has not
measured a source yet is priced by the policy's fallbacks (`host_weight`, `disk_weight`,
`transfer_weight` per token).

API: `TierCosts`, `tier_cost`, `pull_cost`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdcluster.router.routing.policy import NodeView, PolicyConfig


@dataclass(frozen=True, slots=True)
class TierCosts:
    """What a node measured about getting KV from elsewhere than its device: each source's
    bandwidth (bytes/s; 0: not measured, or no such tier) and fixed latency per load, its KV
    bytes per token, and its prefill rate, which turns seconds into prompt tokens."""

    prefill_tokens_per_s: float
    kv_bytes_per_token: float
    host_bytes_per_s: float = 0.0
    host_latency_s: float = 0.0
    disk_bytes_per_s: float = 0.0
    disk_latency_s: float = 0.0
    pull_bytes_per_s: float = 0.0
    pull_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.kv_bytes_per_token > 0):
            raise ValueError("prefill_tokens_per_s and kv_bytes_per_token must be > 0")
        for name in ("host_bytes_per_s", "host_latency_s", "disk_bytes_per_s",
                     "disk_latency_s", "pull_bytes_per_s", "pull_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def tokens(self, num_tokens: int, bytes_per_s: float, latency_s: float) -> float:
        """Loading `num_tokens` tokens' KV at this bandwidth, in prompt tokens of this node's
        prefill time."""
        seconds = latency_s + num_tokens * self.kv_bytes_per_token / bytes_per_s
        return seconds * self.prefill_tokens_per_s


def tier_cost(node: NodeView, config: PolicyConfig) -> float:
    """Loading the node's cached blocks that sit below its device, in prefill tokens."""
    if not (node.host_blocks or node.disk_blocks):
        return 0.0
    bs, costs = config.block_size, node.costs
    host, disk = node.host_blocks * bs, node.disk_blocks * bs
    if costs is None:
        return config.prefill_weight * (config.host_weight * host + config.disk_weight * disk)
    total = 0.0
    if host:
        total += (costs.tokens(host, costs.host_bytes_per_s, costs.host_latency_s)
                  if costs.host_bytes_per_s > 0 else config.host_weight * host)
    if disk:
        total += (costs.tokens(disk, costs.disk_bytes_per_s, costs.disk_latency_s)
                  if costs.disk_bytes_per_s > 0 else config.disk_weight * disk)
    return config.prefill_weight * total


def pull_cost(node: NodeView, num_tokens: int, config: PolicyConfig) -> float:
    """The node pulling `num_tokens` tokens' KV from a peer, in prefill tokens."""
    costs = node.costs
    if costs is None or costs.pull_bytes_per_s <= 0:
        return config.transfer_weight * num_tokens
    return config.prefill_weight * costs.tokens(num_tokens, costs.pull_bytes_per_s,
                                                costs.pull_latency_s)
