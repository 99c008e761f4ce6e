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
                + work_weight    * recent_work(n)

    recent_work(n) = sum over requests r the router sent to n of
                     work(r) * 2 ** (-(now - sent_at(r)) / work_half_life_s)
    work(r)        = uncached prompt tokens it prefills there
                   + output_token_weight * output tokens it decodes there

    cost_P(n) = prefill_weight  * uncached(n) + load(n)        (prefill work left + queue)
    cost_D(n) = transfer_weight * uncached(n) + load(n)        (blocks D lacks must move)

D = argmin cost_D; if uncached(D) <= local_prefill_threshold (or there is no prefill node),
D prefills locally; else P = argmin cost_P. Ties (within `tie_epsilon`) are broken uniformly
at random with the injected RNG.

Why `recent_work`: the first three load terms are what a node reports *now*. At low
utilization its queue is empty most of the time, so they cannot tell a node that served ten
long conversations in the last minute from one that served none, and sticky conversations
pile up cumulative work on a few nodes. `recent_work` is the router's own memory of the work
it sent (`DecayedWork`, kept by the caller and advanced with the caller's clock). Only the
differences between nodes matter to the argmin, so a conversation stays on the node holding
its prefix until that node's excess recent work, times `work_weight`, outweighs recomputing
the prefix elsewhere.

Why this does not herd on a shared prefix: once a prefix is cached on several nodes its
credit is equal on all of them, so load alone decides among them; while it is cached on one
node only, that node's queue (under load) or its recent work (at low load, where the queue
stays empty) grows with every request sent there, and the others win as soon as that
outweighs recomputing the prefix (after which they hold it too). Why it does not starve: with
no prefix overlap the cost is load alone, i.e. least-loaded, recent work breaking what would
be ties.
Metadata unreachable: call with every `cached_blocks=0` (load-only routing).

API: `PolicyConfig`, `NodeView`, `RouteDecision`, `NoHealthyNode`, `DecayedWork`,
`request_work`, `choose_prefill`, `choose_decode`, `route`.
"""

from __future__ import annotations

import math
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
    work_weight: float = 0.03
    output_token_weight: float = 10.0  # node time of one output token / of one prompt token
    work_half_life_s: float = 60.0
    local_prefill_threshold: int = 256
    tie_epsilon: float = 1e-9

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("prefill_weight", "transfer_weight", "queue_weight", "running_weight",
                     "kv_weight", "work_weight", "output_token_weight", "tie_epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if not self.work_half_life_s > 0:
            raise ValueError(f"work_half_life_s must be > 0, got {self.work_half_life_s}")


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
    recent_work: float = 0.0  # DecayedWork.value(node_id, now)

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
            + config.kv_weight * min(max(node.kv_usage, 0.0), 1.0)
            + config.work_weight * node.recent_work)


def request_work(uncached: int, output_tokens: int, config: PolicyConfig) -> float:
    """The work one request puts on a node, in prefill-token equivalents."""
    return uncached + config.output_token_weight * output_tokens


class DecayedWork:
    """Work recently sent to each node, halved every `half_life_s` seconds of the caller's
    clock (`now` is passed in: the live router's monotonic clock, or trace time in the replay).

    Stored as work * 2 ** ((sent_at - epoch) / half_life_s), so an update is one addition and
    reading every node costs one exp2; the epoch moves forward (rescaling everything) every
    `REBASE_HALF_LIVES` half-lives, long before the scaled values could overflow.
    """

    REBASE_HALF_LIVES = 64

    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._epoch: float | None = None
        self._scaled: dict[NodeId, float] = {}

    def _decay(self, now: float) -> float:
        """2 ** (-(now - epoch) / half_life): what one unit stored at the epoch is worth now."""
        return 1.0 if self._epoch is None else math.exp2((self._epoch - now) / self.half_life_s)

    def value(self, node_id: NodeId, now: float) -> float:
        return self._scaled.get(node_id, 0.0) * self._decay(now)

    def values(self, now: float) -> dict[NodeId, float]:
        decay = self._decay(now)
        return {node_id: scaled * decay for node_id, scaled in self._scaled.items()}

    def add(self, node_id: NodeId, work: float, now: float) -> None:
        if self._epoch is None or now - self._epoch > self.REBASE_HALF_LIVES * self.half_life_s:
            self._scaled = self.values(now)
            self._epoch = now
        self._scaled[node_id] = self._scaled.get(node_id, 0.0) + work / self._decay(now)

    def join(self, node_id: NodeId, now: float) -> None:
        """Register a node at the known nodes' mean (0 for the first ones): a node that joins
        a busy cluster is not flooded until it has caught up with the others."""
        if node_id in self._scaled:
            return
        known = self.values(now)
        self.add(node_id, sum(known.values()) / len(known) if known else 0.0, now)


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


def _cheapest(nodes: Sequence[NodeView], role: str, uncached_weight: float,
              num_prompt_tokens: int, config: PolicyConfig, rng: random.Random) -> NodeView:
    """The `role` node minimising uncached_weight * uncached tokens + load."""
    cands = _candidates(nodes, role)
    costs = [uncached_weight * uncached_tokens(n, num_prompt_tokens, config)
             + load_cost(n, config) for n in cands]
    return _argmin(cands, costs, rng, config.tie_epsilon)


def choose_prefill(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                   rng: random.Random) -> NodeView:
    """The prefill node with the least prefill work left plus load."""
    return _cheapest(nodes, "prefill", config.prefill_weight, num_prompt_tokens, config, rng)


def choose_decode(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                  rng: random.Random) -> NodeView:
    """The decode node with the fewest blocks to receive plus load."""
    return _cheapest(nodes, "decode", config.transfer_weight, num_prompt_tokens, config, rng)


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
