"""The routing policy: a pure cost function from (prefix hits, load) to a placement. No I/O.

Inputs, per candidate node (`NodeView`): how many leading blocks of the request it holds (from
the metadata service), and its load (queued prefill tokens, running requests, KV usage, as in
`core.node_wire.LoadReport`). Output (`RouteDecision`): the decode node D and the prefill node
P, or `prefill_node=None` when D prefills locally.

Every cost is in *prefill-token equivalents* (the unit of the work a node must do):

    uncached(n) = max(0, prompt_tokens - cached_blocks(n) * block_size)
    load(n)     = queue_weight   * queued_prefill_tokens(n)
                + running_weight * num_running(n)
                + kv_weight      * kv_usage(n)                 (kv_usage in [0, 1])

    cost_P(n) = prefill_weight  * uncached(n) + load(n)        (prefill work left + queue)
    cost_D(n) = transfer_weight * uncached(n) + load(n)        (blocks D lacks must move)

D = argmin cost_D; if uncached(D) <= local_prefill_threshold (or there is no prefill node),
D prefills locally; else P = argmin cost_P. Ties (within `tie_epsilon`) are broken uniformly
at random with the injected RNG.

Why this does not herd on a shared prefix: once a prefix is cached on several nodes its
credit is equal on all of them, so load alone decides among them; while it is cached on one
node only, that node's queue grows with every request sent there and the others win as soon
as the queue outweighs recomputing the prefix (after which they hold it too). Why it does not
starve: with no prefix overlap the cost is load alone, i.e. least-loaded with random ties.
Metadata unreachable: call with every `cached_blocks=0` (load-only routing).

API: `PolicyConfig`, `NodeView`, `RouteDecision`, `NoHealthyNode`, `choose_prefill`,
`choose_decode`, `route`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from core.types import NodeId

ROLES = ("prefill", "decode", "both")


class NoHealthyNode(Exception):
    """No node can take the request (none known, all draining, or none of the needed role)."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    block_size: int = 16
    prefill_weight: float = 1.0
    transfer_weight: float = 0.25
    queue_weight: float = 0.5
    running_weight: float = 16.0
    kv_weight: float = 512.0
    local_prefill_threshold: int = 256
    tie_epsilon: float = 1e-9

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("prefill_weight", "transfer_weight", "queue_weight", "running_weight",
                     "kv_weight", "tie_epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")


@dataclass(frozen=True, slots=True)
class NodeView:
    """One candidate as the policy sees it."""

    node_id: NodeId
    role: str = "both"
    cached_blocks: int = 0
    queued_prefill_tokens: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    draining: bool = False

    def can(self, role: str) -> bool:
        return not self.draining and self.role in (role, "both")


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode_node: NodeId
    prefill_node: NodeId | None  # None: the decode node prefills locally
    cached_tokens: int  # prompt tokens the prefilling node already holds
    reason: str  # "local_prefill" | "remote_prefill"


def uncached_tokens(node: NodeView, num_prompt_tokens: int, config: PolicyConfig) -> int:
    return max(0, num_prompt_tokens - node.cached_blocks * config.block_size)


def load_cost(node: NodeView, config: PolicyConfig) -> float:
    return (config.queue_weight * node.queued_prefill_tokens
            + config.running_weight * node.num_running
            + config.kv_weight * min(max(node.kv_usage, 0.0), 1.0))


def _argmin(nodes: Sequence[NodeView], costs: Sequence[float], rng: random.Random,
            epsilon: float) -> NodeView:
    best = min(costs)
    tied = [n for n, c in zip(nodes, costs, strict=True) if c <= best + epsilon]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def _candidates(nodes: Sequence[NodeView], role: str) -> list[NodeView]:
    found = [n for n in nodes if n.can(role)]
    if not found:
        raise NoHealthyNode(f"no {role} node available among {len(nodes)} known")
    return found


def choose_prefill(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                   rng: random.Random) -> NodeView:
    """The prefill node with the least prefill work left plus load."""
    cands = _candidates(nodes, "prefill")
    costs = [config.prefill_weight * uncached_tokens(n, num_prompt_tokens, config)
             + load_cost(n, config) for n in cands]
    return _argmin(cands, costs, rng, config.tie_epsilon)


def choose_decode(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                  rng: random.Random) -> NodeView:
    """The decode node with the fewest blocks to receive plus load."""
    cands = _candidates(nodes, "decode")
    costs = [config.transfer_weight * uncached_tokens(n, num_prompt_tokens, config)
             + load_cost(n, config) for n in cands]
    return _argmin(cands, costs, rng, config.tie_epsilon)


def route(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
          rng: random.Random) -> RouteDecision:
    """Pick D, then decide whether D prefills locally or which P prefills for it."""
    if num_prompt_tokens < 1:
        raise ValueError("a request needs at least one prompt token")
    decode = choose_decode(nodes, num_prompt_tokens, config, rng)
    local_work = uncached_tokens(decode, num_prompt_tokens, config)
    has_prefill = any(n.can("prefill") and n.node_id != decode.node_id for n in nodes)
    if local_work <= config.local_prefill_threshold or not has_prefill:
        return RouteDecision(decode.node_id, None, num_prompt_tokens - local_work,
                             "local_prefill")
    prefill = choose_prefill(nodes, num_prompt_tokens, config, rng)
    if prefill.node_id == decode.node_id:
        return RouteDecision(decode.node_id, None, num_prompt_tokens - local_work,
                             "local_prefill")
    cached = num_prompt_tokens - uncached_tokens(prefill, num_prompt_tokens, config)
    return RouteDecision(decode.node_id, prefill.node_id, cached, "remote_prefill")
