"""The metadata service's side of the store's replication (`store.StoreSink`): what other
replicas and etcd's lease expiry change, applied to this replica's registry and index.

Mixed into ``MetadataService`` (state lives there). A remote registration that changes a live
node's epoch, key or address is a new incarnation here too (its blocks leave the index and
its watchers see it go); one that does not only refreshes the record, proof hash included. A
deregistration elsewhere arrives as a tombstone naming the epoch that left
(``remote_node_gone``); a bare delete is a lease that ended (``remote_node_down``), which the
replica that keeps the node alive writes back (it stood still past the TTL).

API: ``NodeEntry`` (one registered node as the service keeps it), ``ReplicaSink``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.core.types import BlockHash, NodeId
from pdcluster.metadata_service.codec import Delta
from pdcluster.metadata_service.identities import ClientKeys, identity_changed
from pdcluster.metadata_service.stall import StallClock
from pdcluster.metadata_service.store import IndexStore, NodeState
from pdcluster.metadata_service.watch import NodeWatch, WatchedIndex
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeEntry:
    info: pb.NodeInfo
    lease_ttl_s: int
    epoch: int
    seq: int = 0
    deadline: float | None = None  # memory backend: when the lease expires
    proof_hash: bytes = b""  # of the registration's proof (metadata_service.identities)


class ReplicaSink:
    """The `StoreSink` half of ``MetadataService`` (a mixin)."""

    _nodes: dict[NodeId, NodeEntry]
    _clock: Callable[[], float]
    _stall: StallClock
    index: WatchedIndex
    node_watch: NodeWatch
    store: IndexStore
    clients: ClientKeys
    _drop: Callable[[NodeId], bool]
    _new_incarnation: Callable[[NodeEntry, int], None]

    def remote_node_up(self, info: pb.NodeInfo, lease_ttl_s: int, proof_hash: bytes = b""
                       ) -> None:
        node = self._nodes.get(info.node_id)
        if node is None:
            self.index.add_node(info.node_id)
            node = self._nodes[info.node_id] = NodeEntry(pb.NodeInfo(), lease_ttl_s, info.epoch)
        elif not identity_changed(node.info, info):
            drain_changed = node.info.draining != info.draining
            node.info.CopyFrom(info)  # a refresh elsewhere, or its drain state
            node.proof_hash = proof_hash
            if drain_changed:
                self.node_watch.notify(pb.NodeChange.UP, node.info)
            return
        else:
            self._new_incarnation(node, info.epoch)
            node.deadline = None  # its lease is kept alive elsewhere, not here
        node.proof_hash = proof_hash
        node.info.CopyFrom(info)
        self.node_watch.notify(pb.NodeChange.UP, node.info)

    def remote_node_gone(self, node_id: NodeId, epoch: int) -> None:
        node = self._nodes.get(node_id)
        if node is not None and node.epoch == epoch:  # not a newer registration made here
            self._drop(node_id)

    def remote_client_up(self, key: pb.ClientKey) -> None:
        self.clients.remote_up(key)

    def remote_client_down(self, client_id: str) -> None:
        self.clients.remote_down(client_id)

    def remote_node_down(self, node_id: NodeId) -> None:
        self._stall.tick()  # an etcd delete may come before the sweeper's overdue tick
        node = self._nodes.get(node_id)
        if node is not None and self._is_served_here(node_id, margin_s=node.lease_ttl_s / 4):
            # etcd let the lease of a node this replica keeps alive expire: this process
            # stood still past the TTL (the node's own lease was renewed well within it)
            logger.warning("node %s: its etcd lease expired while the service stalled; "
                           "writing it back", node_id)
            self.store.node_up(node.info, node.lease_ttl_s, False, node.proof_hash)
            return
        self._drop(node_id)

    def remote_delta(self, node_id: NodeId, delta: Delta) -> None:
        node = self._nodes.get(node_id)
        if node is None or (delta.epoch == node.epoch and delta.seq < node.seq):
            return
        if delta.cleared:
            self.index.clear_node(node_id)
        self.index.remove_blocks(node_id, delta.removed)
        self.index.add_blocks(node_id, delta.added)
        node.epoch, node.seq = delta.epoch, delta.seq

    def remote_reload(self, states: list[NodeState]) -> None:
        """etcd's view after an outage: take it for every node, except those this replica
        serves right now (their lease is kept alive here), whose in-memory state is newer."""
        loaded = {state.info.node_id for state in states}
        for node_id in [n for n in self._nodes if n not in loaded]:
            if not self._is_served_here(node_id):
                self._drop(node_id)
        for state in states:
            if not self._is_served_here(state.info.node_id):
                self._install(state)

    def node_snapshot(self, node_id: NodeId) -> tuple[int, int, set[BlockHash]] | None:
        node = self._nodes.get(node_id)
        if node is None:
            return None
        return node.epoch, node.seq, set(self.index.node_blocks(node_id))

    def _is_served_here(self, node_id: NodeId, margin_s: float = 0.0) -> bool:
        node = self._nodes.get(node_id)
        return (node is not None and node.deadline is not None
                and node.deadline > self._clock() + margin_s)

    def _install(self, state: NodeState) -> None:
        node_id = state.info.node_id
        self.remote_node_up(state.info, state.lease_ttl_s, state.proof_hash)
        node = self._nodes[node_id]
        self.index.replace_node_blocks(node_id, state.block_hashes)
        node.epoch, node.seq = state.epoch, state.seq
