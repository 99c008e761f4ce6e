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
                + work_weight    * recent_work(n)              (0 by default)
    balance(n)  = prompt_tokens * (balance_tilt * over(n)
                                   + max(0, over(n) - balance_slack) / balance_ramp)
    over(n)     = (recent_work(n) - mean) / max(mean, balance_floor_prompts * prompt_tokens)
                  (mean: over the nodes that can take the same role)

    recent_work(n) = sum over requests r the router sent to n of
                     work(r) * 2 ** (-(now - sent_at(r)) / work_half_life_s)
    work(r)        = uncached prompt tokens it prefills there
                   + output_token_weight * output tokens it decodes there

    cost_P(n) = prefill_weight  * uncached(n) + load(n) + balance(n)
    cost_D(n) = transfer_weight * uncached(n) + load(n) + balance(n)

KV tiers: a node's cached blocks may sit in its host memory or on its disk rather than on
the device; loading them back costs time, not compute. Both costs add tiered(n) =
prefill_weight x the prompt tokens the node would prefill while loading its host_blocks(n)
and disk_blocks(n), from its own measured figures (router/routing/tier_costs.py has the
formula; `host_weight` / `disk_weight` per token before it has measured). So a device hit is
free, a host load costs a few percent of a recompute, a peer pull (below) a little more.

D = argmin cost_D; if uncached(D) <= local_prefill_threshold (or there is no prefill node),
D prefills locally; else P = argmin cost_P. Ties (within `tie_epsilon`) are broken uniformly
at random with the injected RNG.

Global prefix reuse: let best = the most leading blocks any node holds (capped below the
block of the last prompt token, which the prefilling node always computes). A prefilling
node n holding fewer may pull the difference from that holder over the KV connector instead
of recomputing it, when pulled(n) * block_size >= global_reuse_min_tokens (0: never) and the
pull costs less than the recompute it saves. A pulled token costs the node's measured pull
time, priced as above (`TierCosts.pull_*`), or `transfer_weight` before it has pulled:

    pulled(n)  = best - cached_blocks(n)   if that is worth a pull, else 0
    cost_P(n) -= prefill_weight * pulled(n) * block_size - pull_cost(n, pulled(n) * block_size)

and D's local work shrinks the same way. The decision names the holder (`prefix_source`).

Why `recent_work`: the first three load terms are what a node reports *now*. At low
utilization its queue is empty most of the time, so they cannot tell a node that served ten
long conversations in the last minutes from one that served none, and sticky conversations
pile up cumulative work on a few nodes. `recent_work` is the router's own memory of the work
it sent (`router.routing.load_decay.DecayedWork`, kept by the caller and advanced with its clock).

Why the balance term has a dead band (adaptive, not a price per token): a load term that is
charged everywhere gives away hits for balance nobody needs (a follow-up moved off its node
because that node did slightly more work). Here a node's excess recent work costs nothing
up to `balance_slack` (5%) above the mean; past it the charge rises to the whole prompt over
`balance_ramp` (10%), so a node that far ahead takes nothing new, and in between a request
leaves it only if it would lose less than (over - slack) / ramp of its prompt: the cheap
requests move first, the long conversations last. The term is relative (to the mean and to
the request's own prompt), so one setting serves 8 or 64 nodes, short or long prompts, light
or heavy load, without per-trace settings. The small `balance_tilt` steers the choices that
hits leave open (a new conversation whose only hit is a system prompt every node holds) to
the nodes below the mean; it stays far below a block of hits. The queue term stays linear:
`queue_weight` prices each queued token (real delay) against each prefill token saved, at
0.35: a request leaves its prefix for a queue shorter by about three times the recompute.
`balance_floor_prompts` keeps a near-idle cluster from bouncing a lone conversation at once:
its node's excess is measured against at least 8 of its prompts of work, so it moves only once
that node's recent work passes about 1.3 prompts (its first turn and a few follow-ups). The
half-life (300 s) spans a few conversations per node, so the balance tracks cumulative work
rather than the last burst.

Why this does not herd on a shared prefix: while a prefix is cached on one node only, that
node's recent work grows with every request sent there until it passes the slack, and the
others then win the requests the prefix alone cannot hold (after which they hold it too and
load alone decides). Why it does not starve: with no prefix overlap the cost is load alone,
i.e. least-loaded, the tilt breaking ties. Metadata unreachable: all `cached_blocks=0`.

Speed: one pass over the candidates per role, arithmetic inline; 64 nodes in tens of µs.

API: `PolicyConfig`, `NodeView`, `RouteDecision`, `request_work`, `choose_prefill`, `route`,
`pull_source`; the tier prices are `router.routing.tier_costs`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdcluster.core.roles import Role
from pdcluster.core.types import NodeId
from pdcluster.router.errors import NoHealthyNode
from pdcluster.router.routing.tier_costs import TierCosts, pull_cost, tier_cost


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    # tokens per KV block; 0: unset, and prefix hits cannot be priced. The live router binds
    # its cluster's (router.routing.identity), a simulation sets its own
    block_size: int = 0
    prefill_weight: float = 1.0
    transfer_weight: float = 0.25
    queue_weight: float = 0.35
    running_weight: float = 16.0
    kv_weight: float = 512.0
    work_weight: float = 0.0  # a plain charge per token of recent work (the old balance term)
    output_token_weight: float = 10.0  # node time of one output token / of one prompt token
    work_half_life_s: float = 300.0
    # the balance term (module docstring): free up to `balance_slack` above the mean recent
    # work, then rising to the whole prompt over `balance_ramp`; `balance_tilt` steers
    # choices that hits leave open; the mean counts as at least `balance_floor_prompts`
    # prompts of work (an idle cluster keeps its conversations where they are)
    balance_slack: float = 0.05
    balance_ramp: float = 0.1
    balance_tilt: float = 0.03
    balance_floor_prompts: float = 8.0
    local_prefill_threshold: int = 256
    global_reuse_min_tokens: int = 512  # pull a prefix at least this long; 0: never pull
    tie_epsilon: float = 1e-9
    # per token loaded from a node's host / disk tier, until the node has measured the tier
    host_weight: float = 0.05
    disk_weight: float = 0.2

    def load_only(self) -> PolicyConfig:
        """This configuration blind to prefixes and to the router's memory of work: the
        least-loaded baseline."""
        return replace(self, prefill_weight=0.0, work_weight=0.0, global_reuse_min_tokens=0,
                       balance_slack=0.0, balance_tilt=0.0)

    def __post_init__(self) -> None:
        if self.block_size < 0:
            raise ValueError(f"block_size must be >= 0 (0: unset), got {self.block_size}")
        for name in ("prefill_weight", "transfer_weight", "queue_weight", "running_weight",
                     "kv_weight", "work_weight", "output_token_weight", "tie_epsilon",
                     "balance_slack", "balance_tilt", "balance_floor_prompts", "host_weight",
                     "disk_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_prefill_threshold < 0 or self.global_reuse_min_tokens < 0:
            raise ValueError("local_prefill_threshold and global_reuse_min_tokens must be >= 0")
        if not self.balance_ramp > 0:
            raise ValueError(f"balance_ramp must be > 0, got {self.balance_ramp}")
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
    # of cached_blocks, how many the node must load from its host / disk tier
    host_blocks: int = 0
    disk_blocks: int = 0
    costs: TierCosts | None = None  # the node's measured costs; None: the config's weights
    # load_cost(self, config), for a caller that keeps views current and recomputes it on
    # every change of the fields above (router.routing.node_views); None: the policy computes it
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


class _Balance:
    """The balance term of one decision over one pool of nodes (those that can prefill, or
    those that can decode: their work is not alike), see the module docstring."""

    __slots__ = ("on", "_mean", "_scale", "_slack", "_ramp", "_tilt", "_prompt")

    def __init__(self, pool: Sequence[NodeView], num_prompt_tokens: int,
                 config: PolicyConfig) -> None:
        self.on = bool(pool) and (config.balance_slack > 0 or config.balance_tilt > 0)
        self._mean = sum(n.recent_work for n in pool) / len(pool) if self.on else 0.0
        self._scale = max(self._mean, config.balance_floor_prompts * num_prompt_tokens, 1.0)
        self._slack, self._ramp = config.balance_slack, config.balance_ramp
        self._tilt, self._prompt = config.balance_tilt, num_prompt_tokens

    def cost(self, recent_work: float) -> float:
        over = (recent_work - self._mean) / self._scale
        excess = (over - self._slack) / self._ramp if over > self._slack else 0.0
        return self._prompt * (self._tilt * over + excess)


def _score(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig) -> _Scores:
    bs, pw, tw = config.block_size, config.prefill_weight, config.transfer_weight
    live = [n for n in nodes if not n.draining]
    best = _pull_blocks(live, num_prompt_tokens, config)
    scores = _Scores([], [], [], [], best, len(nodes))
    d_nodes, d_costs = scores.decode_nodes.append, scores.decode_costs.append
    p_nodes, p_costs = scores.prefill_nodes.append, scores.prefill_costs.append
    p_balance = _Balance([n for n in live if n.role != "decode"], num_prompt_tokens, config)
    d_balance = _Balance([n for n in live if n.role != "prefill"], num_prompt_tokens, config)
    for n in live:  # conditionals rather than min/max calls: this loop is most of a decision
        uncached = num_prompt_tokens - n.cached_blocks * bs
        uncached = uncached if uncached > 0 else 0
        load = n.load
        if load is None:
            load = load_cost(n, config)
        if n.host_blocks or n.disk_blocks:
            load += tier_cost(n, config)
        if n.role != "prefill":
            d_nodes(n)
            d_costs(tw * uncached + load
                    + (d_balance.cost(n.recent_work) if d_balance.on else 0.0))
        if n.role != "decode":
            p_nodes(n)
            p_costs(pw * uncached + load
                    + (p_balance.cost(n.recent_work) if p_balance.on else 0.0)
                    - (_pull_saving(n, best - n.cached_blocks, config) if best else 0.0))
    return scores


def _pull_saving(node: NodeView, num_blocks: int, config: PolicyConfig) -> float:
    """What pulling `num_blocks` blocks saves `node` over computing them (prefill tokens);
    0 when the pull is too short to make or would cost more than the recompute."""
    num_tokens = num_blocks * config.block_size
    if num_blocks <= 0 or num_tokens < config.global_reuse_min_tokens:
        return 0.0
    saving = config.prefill_weight * num_tokens - pull_cost(node, num_tokens, config)
    return saving if saving > 0 else 0.0


def _pull_blocks(live: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig) -> int:
    """The most leading blocks a live node holds, capped below the block of the last prompt
    token; 0 when global reuse is off."""
    if config.global_reuse_min_tokens <= 0:
        return 0
    most = max((_servable(n) for n in live), default=0)
    if most <= 0:
        return 0
    if config.block_size < 1:
        raise ValueError("prefix hits without a block size: PolicyConfig.block_size is unset")
    return min(most, (num_prompt_tokens - 1) // config.block_size)


def _servable(node: NodeView) -> int:
    """Leading blocks `node` can serve a peer's pull from: a pull is served from device and
    host memory and stops at the first block only on disk, and evictions take a chain's tail
    first, so the disk-only blocks are the end of its hit."""
    return node.cached_blocks - node.disk_blocks


def _pulled(scores: _Scores, node: NodeView, config: PolicyConfig) -> int:
    """Blocks `node` pulls when it prefills (0: it computes everything it lacks)."""
    extra = scores.pull_blocks - node.cached_blocks
    return extra if _pull_saving(node, extra, config) > 0 else 0


def _source(scores: _Scores, nodes: Sequence[NodeView], node: NodeView,
            config: PolicyConfig) -> tuple[NodeId | None, int]:
    """Where `node` pulls its prefix from when it prefills, and how many leading blocks of
    the prompt that holder has (None, 0: no pull)."""
    if not _pulled(scores, node, config):
        return None, 0
    holders = [n for n in nodes if not n.draining and _servable(n) >= scores.pull_blocks]
    # a holder serving from its device rather than its host memory, if there is one
    holder = min(holders, key=lambda n: n.host_blocks)
    return holder.node_id, scores.pull_blocks


def pull_source(nodes: Sequence[NodeView], node: NodeView, num_prompt_tokens: int,
                config: PolicyConfig) -> tuple[NodeId | None, int]:
    """Where `node` pulls its prefix from if it prefills this prompt, and how many leading
    blocks that holder has ((None, 0): no pull): the rule `route` applies, for a caller that
    chose the node itself (the replay)."""
    live = [n for n in nodes if not n.draining]
    scores = _Scores([], [], [], [], _pull_blocks(live, num_prompt_tokens, config), len(nodes))
    return _source(scores, nodes, node, config)


def choose_prefill(nodes: Sequence[NodeView], num_prompt_tokens: int, config: PolicyConfig,
                   rng: random.Random) -> NodeView:
    """The prefill node with the least prefill work left (after any pull) plus load."""
    return _score(nodes, num_prompt_tokens, config).cheapest("prefill", rng, config.tie_epsilon)


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

