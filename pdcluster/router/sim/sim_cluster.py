"""The simulated cluster of `pdcluster replay`: the nodes (router.sim.sim_nodes), the block
index their events feed, the router's decayed work, and how each policy places a request
(`place`): the KV-aware policy with its pulls, the cache-blind baselines, and round-robin over
a shared pool.

The KV-aware policy routes, as the live router does, only on the claims the router can vouch
for (router.routing.attestations): each placement attests the chosen node's prompt blocks
before the node's events reach the index, and the policy's hits come from the index of
attested claims (`Attestations.held`), so on an honest trace nothing is left out
(`unattested_claims` stays 0) and the replay measures what the check costs. With
`ReplayConfig.routers` > 1, request i is placed by router i % routers, which routes only on
what it placed itself (each replica keeps its own attestations): what router-local
attestations cost in reuse behind a load balancer without affinity.

API: `SimCluster`, `Placement`, `policy_config_for`, `place`, `POLICIES`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

from pdcluster.router.routing.attestations import Attestations, ClaimsMirror
from pdcluster.router.routing.load_decay import DecayedWork
from pdcluster.router.routing.policy import PolicyConfig, choose_prefill, pull_source, request_work
from pdcluster.router.sim.replay_config import ReplayConfig, TraceRequest
from pdcluster.router.sim.sim_nodes import (
    TRACE_BLOCK_TOKENS,
    SimNode,
    apply_events,
    node_pull_blocks,
)

POLICIES = ("kv", "round-robin", "least-loaded", "round-robin-pool")


@dataclass(slots=True)
class Placement:
    node: SimNode
    hits: int  # leading blocks held on either tier
    host: int  # of which only on the host
    pulled: int


class SimCluster:
    """The simulated nodes, the index they feed and the router's decayed work."""

    def __init__(self, config: ReplayConfig, pconf: PolicyConfig) -> None:
        self.config, self.pconf = config, pconf
        self.nodes = [SimNode(f"node-{i}", config.node_blocks, config.host_blocks)
                      for i in range(config.num_nodes)]
        self.by_id = {node.node_id: node for node in self.nodes}
        self.index = ClaimsMirror()
        for node in self.nodes:
            self.index.add_node(node.node_id)
        self.routers = [Attestations() for _ in range(config.routers)]
        self.attestations = self.routers[0] if config.routers == 1 else _Replicas(self.routers)
        for table in (*self.routers, self.attestations):
            table.rebase(self.index)
        self.index.attestations = self.attestations
        self.router = 0  # the replica placing the current request
        self.work = DecayedWork(pconf.work_half_life_s)
        self.costs = config.tier_costs()

    def views(self, req: TraceRequest, prefix_aware: bool) -> list:
        # the claims this router vouches for (every placement attests what it sends)
        hits = (dict(self.routers[self.router].held.query(req.block_hashes)) if prefix_aware
                else {})
        recent = self.work.values(req.arrival_s)
        views = []
        for n in self.nodes:
            view = n.view(req.arrival_s, hits.get(n.node_id, 0),
                          self.config.prefill_tokens_per_s, recent.get(n.node_id, 0.0))
            if view.cached_blocks:
                view.host_blocks, view.disk_blocks = self.index.lower_tiers(
                    n.node_id, req.block_hashes[:view.cached_blocks])
            view.costs = self.costs
            views.append(view)
        return views

    def pull(self, req: TraceRequest, views: list, chosen, hits: int) -> int:
        """Blocks the chosen node pulls (the policy names the holder, the node decides)."""
        source_id, source_blocks = pull_source(views, chosen, max(req.input_length, 1),
                                               self.pconf)
        return self._pull_from(req, source_id, source_blocks, hits)

    def pool_pull(self, req: TraceRequest, node: SimNode, hits: int) -> int:
        """Blocks a node pulls from the shared pool: past its own hit, from the longest
        holder the index names, whoever placed the request."""
        matches = self.index.query(req.block_hashes[:(req.input_length - 1)
                                                    // TRACE_BLOCK_TOKENS])
        if not matches or matches[0][1] <= hits:
            return 0
        return self._pull_from(req, matches[0][0], matches[0][1], hits)

    def _pull_from(self, req: TraceRequest, source_id: str | None, source_blocks: int,
                   hits: int) -> int:
        if source_id is None:
            return 0
        pulled = node_pull_blocks(source_blocks, req.input_length // TRACE_BLOCK_TOKENS, hits,
                                  self.config.min_pull_blocks)
        if pulled:
            self.by_id[source_id].touch(req.block_hashes[:hits + pulled])
        return pulled

    def serve(self, req: TraceRequest, placed: Placement) -> float:
        """Charge, queue and cache one request; returns its TTFT."""
        config, node = self.config, placed.node
        computed = max(0, req.input_length - (placed.hits + placed.pulled) * TRACE_BLOCK_TOKENS)
        self.work.add(node.node_id, request_work(computed, req.output_length, self.pconf),
                      req.arrival_s)
        prefill_s = config.fixed_s + computed / config.prefill_tokens_per_s
        ready = req.arrival_s + (config.pull_s(placed.pulled) if placed.pulled else 0.0)
        ready += config.host_s(placed.host) if placed.host else 0.0
        start = node.serve(ready, prefill_s + req.output_length / config.decode_tokens_per_s,
                           len(req.block_hashes))
        self.routers[self.router].attest(node.node_id, req.block_hashes)  # it sent them
        apply_events(self.index, node.node_id, node.store(req.block_hashes))
        return start + prefill_s - req.arrival_s


class _Replicas(Attestations):
    """The claims mirror's events, told to every replica's table; counts the claims no
    replica attested."""

    def __init__(self, tables: list[Attestations]) -> None:
        super().__init__()
        self.tables = tables

    def claimed(self, node_id: str, block_hashes) -> None:
        hashes = list(block_hashes)
        for table in self.tables:
            table.claimed(node_id, hashes)
        num = sum(not any(t.attested(node_id, h) for t in self.tables) for h in hashes)
        if num:
            self.unattested_claims[node_id] = self.unattested_claims.get(node_id, 0) + num

    def released(self, node_id: str, block_hashes) -> None:
        hashes = list(block_hashes)
        for table in self.tables:
            table.released(node_id, hashes)

    def drop_node(self, node_id: str) -> None:
        for table in self.tables:
            table.drop_node(node_id)


def policy_config_for(policy: str, policy_config: PolicyConfig | None,
                   config: ReplayConfig) -> PolicyConfig:
    # the trace's block hashes are of blocks of TRACE_BLOCK_TOKENS: its KV identity
    pconf = replace(policy_config or PolicyConfig(), block_size=TRACE_BLOCK_TOKENS)
    if not config.global_reuse:
        pconf = replace(pconf, global_reuse_min_tokens=0)
    if policy == "least-loaded":
        pconf = pconf.load_only()
    return pconf


def place(cluster: SimCluster, req: TraceRequest, i: int, policy: str,
           rng: random.Random) -> Placement:
    cluster.router = i % len(cluster.routers)
    if policy in ("round-robin", "round-robin-pool"):
        node = cluster.nodes[i % len(cluster.nodes)]
        hits, host = node.leading_tiers(req.block_hashes)
        pulled = cluster.pool_pull(req, node, hits) if policy == "round-robin-pool" else 0
        return Placement(node, hits, host, pulled)
    views = cluster.views(req, prefix_aware=policy == "kv")
    chosen = choose_prefill(views, max(req.input_length, 1), cluster.pconf, rng)
    node = cluster.by_id[chosen.node_id]
    hits, host = node.leading_tiers(req.block_hashes)
    pulled = cluster.pull(req, views, chosen, hits) if policy == "kv" else 0
    return Placement(node, hits, host, pulled)
