"""`NodeViews`: the policy's view of every node (`router.routing.policy.NodeView`), kept current at
a small cost per decision — the router's hot path runs it for every request.

One `NodeView` per node lives as long as the node; nothing is allocated per decision. For
each decision:

- a node's load fields (its last `LoadReport` plus the prompt tokens and requests the router
  sent it since) are recomputed only when the node's `NodeLink.version` moved;
- the list of healthy views is rebuilt only when some node changed;
- `cached_blocks` (and `host_blocks` / `disk_blocks`, the part a node holds only below its
  device) is reset on the previous request's hit nodes and set on this one's (hits are
  sparse: a prefix is cached on a few nodes);
- `costs` (the node's measured `TierCosts`) follows its load reports;
- `recent_work` is re-decayed for every node once per `half_life / DECAY_STEPS` of the clock,
  and set exactly for a node when work is charged to it (`charged`). Between re-decays a
  node's value is at most `ln 2 / DECAY_STEPS` (0.5%) above the exact one: far below what
  the 0.5 s old load reports already miss;
- each view's `load` (`policy.load_cost`) is recomputed whenever one of its inputs changes
  above, so the policy reads one number per node.

API: `NodeViews`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdcluster.router.routing.load_decay import DecayedWork
from pdcluster.router.routing.node_link import NodeLink
from pdcluster.router.routing.policy import NodeView, PolicyConfig, load_cost

DECAY_STEPS = 128


@dataclass(slots=True)
class _Entry:
    node: NodeLink
    view: NodeView
    seen_version: int = -1  # the node's version the view's load fields reflect


class NodeViews:
    def __init__(self, work: DecayedWork, config: PolicyConfig,
                 clock: Callable[[], float]) -> None:
        self._work = work
        self._config = config
        self._clock = clock
        self._decay_step_s = work.half_life_s / DECAY_STEPS
        self._decayed_at = float("-inf")
        self._entries: dict[str, _Entry] = {}
        self._healthy: list[NodeView] = []
        self._healthy_stale = True
        self._hit: list[NodeView] = []

    def add(self, node: NodeLink) -> None:
        """Track `node` (replacing an earlier client of the same id)."""
        view = NodeView(node.node_id, node.spec.role,
                        recent_work=self._work.value(node.node_id, self._clock()))
        view.load = load_cost(view, self._config)
        self._entries[node.node_id] = _Entry(node, view)
        self._healthy_stale = True

    def remove(self, node_id: str) -> None:
        """Stop tracking `node_id` (it is no longer routed to)."""
        if self._entries.pop(node_id, None) is not None:
            self._healthy_stale = True
            self._hit = [view for view in self._hit if view.node_id != node_id]

    def charged(self, node_id: str) -> None:
        """Work was just charged to `node_id`: its recent work, exactly, now."""
        entry = self._entries.get(node_id)
        if entry is not None:
            entry.view.recent_work = self._work.value(node_id, self._clock())
            entry.view.load = load_cost(entry.view, self._config)

    def current(self, hits: Mapping[str, int]) -> list[NodeView]:
        """The healthy nodes' views with this request's `hits` (leading blocks per node).
        The list and the views are reused by the next call: decide before calling again."""
        now = self._clock()
        if now - self._decayed_at >= self._decay_step_s:
            self._decayed_at = now
            decay, scaled, config = self._work.decay(now), self._work.scaled, self._config
            for entry in self._entries.values():
                view = entry.view
                view.recent_work = scaled.get(view.node_id, 0.0) * decay
                view.load = load_cost(view, config)
        for entry in self._entries.values():
            if entry.node.version != entry.seen_version:
                entry.seen_version = entry.node.version
                _load_fields(entry.node, entry.view)
                entry.view.load = load_cost(entry.view, self._config)
                self._healthy_stale = True
        if self._healthy_stale:
            self._healthy = [e.view for e in self._entries.values() if e.node.healthy]
            self._healthy_stale = False
        for view in self._hit:
            view.cached_blocks = view.host_blocks = view.disk_blocks = 0
        self._hit.clear()
        lower = getattr(hits, "lower", None) or {}
        for node_id, blocks in hits.items():
            hit = self._entries.get(node_id)
            if hit is not None:
                hit.view.cached_blocks = blocks
                hit.view.host_blocks, hit.view.disk_blocks = lower.get(node_id, (0, 0))
                self._hit.append(hit.view)
        return self._healthy


def _load_fields(node: NodeLink, view: NodeView) -> None:
    report = node.report
    view.queued_prefill_tokens, view.num_running = node.pending_tokens, node.num_inflight
    if report is not None:
        view.queued_prefill_tokens += report.queued_prefill_tokens
        view.num_running = max(view.num_running, report.num_running)
        total = report.num_total_blocks
        view.kv_usage = 1.0 - report.num_free_blocks / total if total > 0 else 0.0
        view.draining = report.draining
        view.costs = report.kv_costs
