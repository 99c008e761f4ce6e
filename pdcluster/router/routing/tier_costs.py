"""The prices of KV that a node does not hold on its device, for the routing policy
(`router.routing.policy`): loading its own blocks back from its host memory or disk, and
pulling blocks from a peer. All in prefill-token equivalents, the policy's unit.

Each node measures what it costs (`core.node_wire.KVCosts`, here `TierCosts`: a tier's
bandwidth and fixed latency per load, its KV bytes per token and its prefill rate) and
reports it with its load (`LoadReport.kv_costs`); a load of `tokens` then costs

    (latency_s + tokens * kv_bytes_per_token / bytes_per_s) * prefill_tokens_per_s

prompt tokens: the tokens the node would have prefilled in that time. A node that has not
measured a source yet is priced by the policy's fallbacks (`host_weight`, `disk_weight`,
`transfer_weight` per token).

API: `TierCosts` (core's `KVCosts`), `tier_cost`, `pull_cost`.
"""

from __future__ import annotations

from typing import Protocol

from pdcluster.core.node_wire import KVCosts as TierCosts


class NodeView(Protocol):
    """What pricing reads of a `policy.NodeView` (structural: no import of the policy)."""

    host_blocks: int
    disk_blocks: int
    costs: TierCosts | None


class PolicyConfig(Protocol):
    """What pricing reads of a `policy.PolicyConfig`."""

    @property
    def block_size(self) -> int: ...

    @property
    def prefill_weight(self) -> float: ...

    @property
    def transfer_weight(self) -> float: ...

    @property
    def host_weight(self) -> float: ...

    @property
    def disk_weight(self) -> float: ...


__all__ = ["TierCosts", "pull_cost", "tier_cost"]


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
