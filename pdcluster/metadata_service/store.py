"""The storage interface behind the index, and the in-memory backend (the embedded default).

The service owns the in-memory index and serves every query from it; a store only makes it
durable and shares it between replicas. Every write-side method is synchronous and must not
block: a store queues the change and persists it in the background, so ingest never waits on
(or fails because of) etcd. A store reports changes made elsewhere (other replicas, lease
expiry in etcd) back through the ``StoreSink`` the service hands to ``start``.

API: ``NodeState``, ``StoreSink``, ``IndexStore`` (the interface; its no-op methods are the
memory backend's behaviour) and ``MemoryIndexStore``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pdcluster.core.types import BlockHash, NodeId
from pdcluster.metadata_service.codec import Delta
from pdcluster.proto import metadata_pb2 as pb


@dataclass(slots=True)
class NodeState:
    """A node as a store knows it: registration, lease TTL, position and block set."""

    info: pb.NodeInfo
    lease_ttl_s: int
    epoch: int = 0
    seq: int = 0
    block_hashes: set[BlockHash] = field(default_factory=set)
    proof_hash: bytes = b""  # of its registration's proof (metadata_service.identities)


class StoreSink(Protocol):
    """What a store may tell the service (all calls on the service's event loop)."""

    def remote_node_up(self, info: pb.NodeInfo, lease_ttl_s: int, proof_hash: bytes = b""
                       ) -> None: ...

    def remote_node_gone(self, node_id: NodeId, epoch: int) -> None:
        """The node's incarnation `epoch` deregistered (or was released) on another replica."""
        ...

    def remote_client_up(self, key: pb.ClientKey) -> None:
        """A router's key registered (or renewed) on another replica."""
        ...

    def remote_client_down(self, client_id: str) -> None:
        """A router's key left (its lease in etcd ended)."""
        ...

    def remote_node_down(self, node_id: NodeId) -> None: ...

    def remote_delta(self, node_id: NodeId, delta: Delta) -> None: ...

    def remote_reload(self, states: list[NodeState]) -> None: ...

    def node_snapshot(self, node_id: NodeId) -> tuple[int, int, set[BlockHash]] | None:
        """(epoch, seq, a copy of the block set) of a live node, None if unknown."""
        ...


class IndexStore:
    """The storage interface. The base class persists nothing: it is the memory backend."""

    name = "memory"
    persistence_policy = "none: memory only, the index lives as long as the process"
    # True: the service expires leases itself (memory). False: the store reports expiry.
    expires_leases_locally = True

    async def start(self, sink: StoreSink) -> list[NodeState]:
        """Connect; return every node (with its blocks) to rebuild the index from."""
        return []

    async def close(self) -> None:
        """Flush what can be flushed and disconnect."""

    @property
    def healthy(self) -> bool:
        return True

    @property
    def status(self) -> str:
        return "disabled"

    @property
    def num_pending_nodes(self) -> int:
        return 0

    @property
    def num_writes(self) -> int:
        return 0

    def node_up(self, info: pb.NodeInfo, lease_ttl_s: int, restarted: bool,
                proof_hash: bytes = b"") -> None:
        """A node registered here (``restarted``: a new incarnation, its blocks were dropped),
        with the hash of its registration's proof, which every replica must enforce."""

    def client_up(self, key: pb.ClientKey, lease_ttl_s: int) -> None:
        """A router registered (or renewed) its key here, for ``lease_ttl_s``."""

    def node_alive(self, node_id: NodeId) -> None:
        """A node's heartbeat arrived here: keep its lease alive."""

    def node_down(self, node_id: NodeId) -> None:
        """A node deregistered or expired: drop its registration and blocks."""

    def blocks_stored(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        """Blocks the node now holds (already applied to the index)."""

    def blocks_removed(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        """Blocks the node no longer holds."""

    def blocks_cleared(self, node_id: NodeId) -> None:
        """The node holds no block any more (a clear event, or before a snapshot's blocks)."""

    def position(self, node_id: NodeId, epoch: int, seq: int) -> None:
        """The node's events are applied up to ``seq`` of ``epoch``."""


class MemoryIndexStore(IndexStore):
    """The in-memory backend: nothing survives the process; the service expires leases."""
