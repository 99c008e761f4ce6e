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

Global prefix reuse: let best = the most leading blocks any node holds (capped below the
block of the last prompt token, which the prefilling node always computes). A prefilling
node n holding fewer may pull the difference from that holder over the KV connector instead
of recomputing it, when pulled(n) * block_size >= global_reuse_min_tokens (0: never); each
pulled token then costs transfer_weight instead of prefill_weight:

    pulled(n)  = best - cached_blocks(n)   if that is worth a pull, else 0
    cost_P(n) -= (prefill_weight - transfer_weight) * pulled(n) * block_size

and D's local work shrinks the same way. The decision names the holder (`prefix_source`).

Why `recent_work`: the first three load terms are what a node reports *now*. At low
utilization its queue is empty most of the time, so they cannot tell a node that served ten
long conversations in the last minute from one that served none, and sticky conversations
pile up cumulative work on a few nodes. `recent_work` is the router's own memory of the work
it sent (`router.load_decay.DecayedWork`, kept by the caller and advanced with the caller's clock).
Only the differences between nodes matter to the argmin, so a conversation stays on the node holding
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

Speed: a decision is one pass over the candidates per role with the arithmetic inline (no
per-node calls or allocations); 64 nodes decide in tens of microseconds.

API: `PolicyConfig`, `NodeView`, `RouteDecision`, `request_work`,
`choose_prefill`, `choose_decode`, `route`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.core.roles import Role
from pdcluster.core.types import NodeId
from pdcluster.router.errors import NoHealthyNode


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
    global_reuse_min_tokens: int = 512  # pull a prefix at least this long; 0: never pull
    tie_epsilon: float = 1e-9

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for name in ("prefill_weight", "transfer_weight", "queue_weight", "running_weight",
                     "kv_weight", "work_weight", "output_token_weight", "tie_epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_prefill_threshold < 0 or self.global_reuse_min_tokens < 0:
            raise ValueError("local_prefill_threshold and global_reuse_min_tokens must be >= 0")
        if not self.work_half_life_s > 0:
            raise ValueError(f"work_half_life_s must be > 0, got {self.work_half_life_s}")


@dataclass(slots=True)
class NodeView:
    """One candidate as the policy sees it. Mutable on purpose: the live router keeps one per
    node and refreshes it in place before each decision, so deciding allocates nothing per
    node (`Dispatcher._refresh_views`)."""

    node_id: NodeId
    role: str = Role.BOTH
    cached_blocks: int = 0
    queued_prefill_tokens: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    draining: bool = False
    recent_work: float = 0.0  # DecayedWork.value(node_id, now)
    # load_cost(self, config), for a caller that keeps views current and recomputes it on
    # every change of the fields above (router.node_views); None: the policy computes it
    load: float | None = None

    def can(self, role: str) -> bool:
        return not self.draining and self.role in (role, Role.BOTH)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode_node: NodeId
    prefill_node: NodeId | None  # None: the decode node prefills locally
    cached_tokens: int  # prompt tokens the prefilling node already holds
    reason: str  # "local_prefill" | "remote_prefill"
    prefix_source: NodeId | None = None  # the prefilling node pulls its prefix from here
    prefix_source_blocks: int = 0  # leading blocks of the prompt the source holds


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


def _argmin(nodes: Sequence[NodeView], costs: Sequence[float], rng: random.Random,
            epsilon: float) -> NodeView:
    best = min(costs)
    tied = [n for n, c in zip(nodes, costs, strict=True) if c <= best + epsilon]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


@dataclass(slots=True)
class _Scores:
    """Every live node's cost in each role it can take, from one pass (the hot path)."""

    decode_nodes: list[NodeView]
    decode_costs: list[float]
    prefill_nodes: list[NodeView]
    prefill_costs: list[float]
    pull_blocks: int  # `best` of the module docstring when a pull can be worth it, else 0
    num_known: int

    def cheapest(self, role: str, rng: random.Random, epsilon: float) -> NodeView:
        nodes, costs = ((self.prefill_nodes, self.prefill_costs) if role == "prefill"
                        else (self.decode_nodes, self.decode_costs))
        if not nodes:
            raise NoHealthyNode(f"no {role} node available among {self.num_known} known")
        return _argmin(nodes, costs, rng, epsilon)


def _score(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig) -> _Scores:
    bs, pw, tw = config.block_size, config.prefill_weight, config.transfer_weight
    live = [n for n in nodes if not n.draining]
    best = _pull_blocks(live, num_prompt_tokens, config)
    min_pull, pull_saving = config.global_reuse_min_tokens, (pw - tw) * bs
    scores = _Scores([], [], [], [], best, len(nodes))
    d_nodes, d_costs = scores.decode_nodes.append, scores.decode_costs.append
    p_nodes, p_costs = scores.prefill_nodes.append, scores.prefill_costs.append
    for n in live:  # conditionals rather than min/max calls: this loop is most of a decision
        uncached = num_prompt_tokens - n.cached_blocks * bs
        uncached = uncached if uncached > 0 else 0
        load = n.load
        if load is None:
            load = load_cost(n, config)
        if n.role != "prefill":
            d_nodes(n)
            d_costs(tw * uncached + load)
        if n.role != "decode":
            pulled = best - n.cached_blocks
            p_nodes(n)
            p_costs(pw * uncached + load
                    - (pull_saving * pulled if pulled > 0 and pulled * bs >= min_pull else 0.0))
    return scores


def _pull_blocks(live: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig) -> int:
    """The most leading blocks a live node holds, capped below the block of the last prompt
    token; 0 when global reuse is off or cannot pay."""
    if config.global_reuse_min_tokens <= 0 or config.prefill_weight <= config.transfer_weight:
        return 0
    most = max((n.cached_blocks for n in live), default=0)
    return min(most, (num_prompt_tokens - 1) // config.block_size)


def _pulled(scores: _Scores, node: NodeView, config: PolicyConfig) -> int:
    """Blocks `node` pulls when it prefills (0: it computes everything it lacks)."""
    extra = scores.pull_blocks - node.cached_blocks
    return extra if extra > 0 and extra * config.block_size >= config.global_reuse_min_tokens \
        else 0


def _source(scores: _Scores, nodes: Sequence[NodeView], node: NodeView,
            config: PolicyConfig) -> tuple[NodeId | None, int]:
    """Where `node` pulls its prefix from when it prefills, and how many leading blocks of
    the prompt that holder has (None, 0: no pull)."""
    if not _pulled(scores, node, config):
        return None, 0
    holder = next(n for n in nodes if not n.draining and n.cached_blocks >= scores.pull_blocks)
    return holder.node_id, scores.pull_blocks


def choose_prefill(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                   rng: random.Random) -> NodeView:
    """The prefill node with the least prefill work left (after any pull) plus load."""
    return _score(nodes, num_prompt_tokens, config).cheapest("prefill", rng, config.tie_epsilon)


def choose_decode(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                  rng: random.Random) -> NodeView:
    """The decode node with the fewest blocks to receive plus load."""
    return _score(nodes, num_prompt_tokens, config).cheapest("decode", rng, config.tie_epsilon)


def route(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
          rng: random.Random) -> RouteDecision:
    """Pick D, then decide whether D prefills locally or which P prefills for it, and where
    the prefilling node pulls its prefix from (global prefix reuse)."""
    if num_prompt_tokens < 1:
        raise ValueError("a request needs at least one prompt token")
    scores = _score(nodes, num_prompt_tokens, config)
    decode = scores.cheapest("decode", rng, config.tie_epsilon)
    local_work = (uncached_tokens(decode, num_prompt_tokens, config)
                  - _pulled(scores, decode, config) * config.block_size)
    prefill = decode
    if (local_work > config.local_prefill_threshold
            and any(n is not decode for n in scores.prefill_nodes)):
        prefill = scores.cheapest("prefill", rng, config.tie_epsilon)
    source, source_blocks = _source(scores, nodes, prefill, config)
    cached = num_prompt_tokens - uncached_tokens(prefill, num_prompt_tokens, config)
    if prefill is decode:
        return RouteDecision(decode.node_id, None, cached, "local_prefill", source,
                             source_blocks)
    return RouteDecision(decode.node_id, prefill.node_id, cached, "remote_prefill", source,
                         source_blocks)
