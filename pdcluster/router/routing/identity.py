"""`ClusterIdentity`: the cluster's KV identity as this router holds it (core.kv_identity: block
size, hash algorithm and seed, model, tokenizer digest), and which discovered nodes share it.

The router has no block size or hash scheme of its own: it hashes prompts with the cluster's
(`current`, `hash_config`), so that its block hashes name the blocks the nodes cache.

Where the cluster's identity comes from: `RouterConfig.cluster_identity` when set (the
launcher sets it from cluster.yaml); else the registry. The first nodes this router discovers
pin it: of those whose tokenizer is the router's own and whose identity can hash (a block size,
an algorithm this router knows), the identity most of them share, ties to the smallest node
id's. A router up before its nodes thus takes the first registered node's; a router joining a
running cluster takes its majority's. It stays pinned while registered nodes share it, and is
taken anew only once every registry listing for `REPIN_AFTER_S` (60 s) has named none that
does (the cluster was redeployed with another identity): a node registering with another
identity never takes over from those serving, nor when a metadata service restarts empty or
the nodes restart (they register again well within it).

Quarantine: a discovered node whose identity differs from the cluster's in any field, or whose
tokenizer is not the router's (the router tokenizes every prompt it sends), gets no traffic:
`admit` leaves it out of what the dispatcher routes to and logs a WARNING naming the fields
(once per node and difference). `quarantined` (node -> `Quarantine`) feeds /health and the
metrics. A node is admitted again once it registers with the cluster's identity. Static nodes
(`RouterConfig.nodes`) are the operator's word and are not checked.

API: `ClusterIdentity`, `Quarantine`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdcluster.core.hashing import HashConfig
from pdcluster.core.kv_identity import KVIdentity
from pdcluster.core.types import NodeId
from pdcluster.router.config import NodeSpec

logger = logging.getLogger(__name__)
REPIN_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Why a node gets no traffic: the identity fields that differ, and a readable reason
    naming the node's values and the cluster's."""

    fields: tuple[str, ...]
    reason: str


class ClusterIdentity:
    def __init__(self, tokenizer_digest: str, explicit: KVIdentity | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if explicit is not None and explicit.tokenizer_digest != tokenizer_digest:
            raise ValueError(f"the router's tokenizer ({tokenizer_digest or 'none'}) is not "
                             f"the cluster identity's ({explicit.tokenizer_digest or 'none'})")
        self.tokenizer_digest = tokenizer_digest  # the router's own (core.kv_identity)
        self.explicit = explicit
        self.current: KVIdentity | None = None
        self.hash_config: HashConfig | None = None
        self.source = ""  # "config", or the node the registry's identity was taken from
        self.quarantined: dict[NodeId, Quarantine] = {}
        self._clock = clock
        self._unshared_since: float | None = None  # since when no listing named a sharer
        if explicit is not None:
            self._pin(explicit, "config")

    def admit(self, discovered: Sequence[NodeSpec]) -> list[NodeSpec]:
        """The nodes of `discovered` (the registry's whole list) that share the cluster's
        identity; the others go to `quarantined`."""
        self._drop_if_abandoned(discovered)
        if self.current is None:
            self._pin_from(discovered)
        admitted: list[NodeSpec] = []
        quarantined: dict[NodeId, Quarantine] = {}
        for spec in discovered:
            verdict = self._check(spec)
            if verdict is None:
                admitted.append(spec)
                continue
            quarantined[spec.node_id] = verdict
            if self.quarantined.get(spec.node_id) != verdict:
                logger.warning("node %s quarantined, it gets no requests: its KV identity "
                               "differs from the cluster's: %s", spec.node_id, verdict.reason)
        for node_id in self.quarantined.keys() - quarantined.keys():
            if any(spec.node_id == node_id for spec in admitted):
                logger.info("node %s now shares the cluster's KV identity: admitted", node_id)
        self.quarantined = quarantined
        return admitted

    def _drop_if_abandoned(self, discovered: Sequence[NodeSpec]) -> None:
        current = self.current
        if self.explicit is not None or current is None:
            return
        if any(spec.identity == current for spec in discovered):
            self._unshared_since = None
            return
        now = self._clock()
        if self._unshared_since is None:
            self._unshared_since = now
        elif now - self._unshared_since >= REPIN_AFTER_S:
            logger.warning("no registered node has shared the cluster's KV identity for %.0f s "
                           "(%s): taking it anew from the registry", REPIN_AFTER_S,
                           current.as_dict())
            self.current = self.hash_config = None
            self.source = ""

    def as_dict(self) -> dict[str, object] | None:
        """The cluster's identity and where it came from, for /health."""
        if self.current is None:
            return None
        return {**self.current.as_dict(), "source": self.source}

    def _check(self, spec: NodeSpec) -> Quarantine | None:
        identity = spec.identity
        if identity is None:
            return None
        if self.current is not None:
            fields = self.current.mismatches(identity)
            if not fields:
                return None
            reasons = [f"{name} {getattr(identity, name)!r} (the cluster's: "
                       f"{getattr(self.current, name)!r})" for name in fields]
            return Quarantine(tuple(fields), "; ".join(reasons))
        # nothing pinned: no node could pin, so this one cannot hash or has another tokenizer
        if identity.tokenizer_digest != self.tokenizer_digest:
            return Quarantine(("tokenizer_digest",), f"tokenizer_digest "
                              f"{identity.tokenizer_digest!r} (the router's: "
                              f"{self.tokenizer_digest!r})")
        problems = identity.problems()
        return Quarantine(tuple(problems), "; ".join(problems.values()))

    def _pin_from(self, discovered: Sequence[NodeSpec]) -> None:
        candidates = [s for s in discovered if s.identity is not None
                      and s.identity.tokenizer_digest == self.tokenizer_digest
                      and not s.identity.problems()]
        if not candidates:
            return
        counts = Counter(s.identity for s in candidates)
        first = min(candidates, key=lambda s: (-counts[s.identity], s.node_id))
        assert first.identity is not None, "candidates declare an identity"
        self._pin(first.identity, f"node {first.node_id}")
        logger.info("cluster KV identity taken from the registry (node %s; %d of %d nodes "
                    "share it): %s", first.node_id, counts[first.identity], len(discovered),
                    first.identity.as_dict())

    def _pin(self, identity: KVIdentity, source: str) -> None:
        self.current, self.hash_config = identity, identity.hash_config
        self.source = source
        self._unshared_since = None
