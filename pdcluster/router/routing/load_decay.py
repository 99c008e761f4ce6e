"""`DecayedWork`: the work the router recently sent each node, decayed with a half-life (the
policy's `recent_work` term; see router/routing/policy.py for why it exists).

API: `DecayedWork`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from pdcluster.core.types import NodeId


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

    def decay(self, now: float) -> float:
        """2 ** (-(now - epoch) / half_life): what one unit stored at the epoch is worth now.
        value(n, now) == scaled[n] * decay(now): a caller reading every node computes this
        once."""
        return 1.0 if self._epoch is None else math.exp2((self._epoch - now) / self.half_life_s)

    @property
    def scaled(self) -> Mapping[NodeId, float]:
        """Each node's work in epoch units (read-only)."""
        return self._scaled

    def value(self, node_id: NodeId, now: float) -> float:
        return self._scaled.get(node_id, 0.0) * self.decay(now)

    def values(self, now: float) -> dict[NodeId, float]:
        decay = self.decay(now)
        return {node_id: scaled * decay for node_id, scaled in self._scaled.items()}

    def add(self, node_id: NodeId, work: float, now: float) -> None:
        if self._epoch is None or now - self._epoch > self.REBASE_HALF_LIVES * self.half_life_s:
            self._scaled = self.values(now)
            self._epoch = now
        self._scaled[node_id] = self._scaled.get(node_id, 0.0) + work / self.decay(now)

    def join(self, node_id: NodeId, now: float) -> None:
        """Register a node at the known nodes' mean (0 for the first ones): a node that joins
        a busy cluster is not flooded until it has caught up with the others."""
        if node_id in self._scaled:
            return
        known = self.values(now)
        self.add(node_id, sum(known.values()) / len(known) if known else 0.0, now)
