"""The cache-blind routing baselines the live trace benchmark compares the KV-aware policy
against (`RouterConfig.routing`): pure decisions over the same `NodeView`s, no I/O.

- `round_robin`: decode nodes in turn; a prompt longer than `local_prefill_threshold` goes to
  the prefill nodes in turn as well (a prompt no longer than that is prefilled by its decode
  node, as the KV policy does for a short uncached prompt). Load and cache contents are
  ignored; draining nodes are skipped.
- `least_loaded`: the KV policy's own cost function with every prefix hit ignored, no work
  memory and no global prefix reuse — the load terms alone decide (`least_loaded_config`:
  `PolicyConfig.load_only`, as in `router.sim.replay`'s least-loaded baseline).

API: `ROUTINGS`, `RoundRobin`, `least_loaded_config`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcluster.core.roles import Role
from pdcluster.router.errors import NoHealthyNode
from pdcluster.router.routing.policy import NodeView, PolicyConfig, RouteDecision

ROUTINGS = ("kv", "round_robin", "least_loaded")


def least_loaded_config(config: PolicyConfig) -> PolicyConfig:
    """`config` with what makes it cache-aware switched off (`PolicyConfig.load_only`, the
    replay's least-loaded baseline too)."""
    return config.load_only()


class RoundRobin:
    """Keeps one turn counter per role, so the sequence is the same for every run."""

    def __init__(self) -> None:
        self._turns: dict[str, int] = {Role.PREFILL: 0, Role.DECODE: 0}

    def route(self, nodes: Sequence[NodeView], num_prompt_tokens: int,
              config: PolicyConfig) -> RouteDecision:
        if num_prompt_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        decode = self._next(nodes, Role.DECODE)
        prefill_nodes = [n for n in nodes if n.can(Role.PREFILL) and n is not decode]
        if num_prompt_tokens <= config.local_prefill_threshold or not prefill_nodes:
            return RouteDecision(decode.node_id, None, 0, "local_prefill")
        prefill = self._next(prefill_nodes, Role.PREFILL)
        return RouteDecision(decode.node_id, prefill.node_id, 0, "remote_prefill")

    def _next(self, nodes: Sequence[NodeView], role: str) -> NodeView:
        candidates = [n for n in nodes if n.can(role)]
        if not candidates:
            raise NoHealthyNode(f"no {role} node available among {len(nodes)} known")
        turn = self._turns[role]
        self._turns[role] = turn + 1
        return candidates[turn % len(candidates)]
