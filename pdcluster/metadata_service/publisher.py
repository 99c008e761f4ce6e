"""The node side of the event protocol: register, number batches, heartbeat, resync.

Protocol, as a node sees it:
  1. ``register``: the reply says the last seq the service holds for this node; if it differs
     from ours (a restarted service, an expired lease), send a snapshot.
  2. ``publish(events)``: seq += 1 and send. RESYNC_NEEDED (a gap: a batch was lost, rejected
     or never arrived) -> send a snapshot; UNKNOWN_NODE -> register (then snapshot).
     A batch that failed to send is simply lost: the next one leaves a gap, which resyncs.
  3. ``heartbeat`` every lease TTL / 3; ``known=False`` -> register again. A heartbeat
     carries the node's drain state (``info.draining``), so the index shows a node leaving.

``snapshot_fn`` returns the node's whole cached block set, consistent with every event
published so far: call the publisher from the thread that drains the block pool's events. A
node with KV tiers returns a map of each hash to its media mask (1 device, 2 host, 4 disk)
instead, so the resynced index keeps the tiers.

API: ``NodePublisher`` (sync) and ``AsyncNodePublisher``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from pdcluster.core.events import KVEvent
from pdcluster.metadata_service.client import AsyncMetadataClient, MetadataClient, SnapshotBlocks
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)

SnapshotFn = Callable[[], SnapshotBlocks]
Status = pb.PublishReply.Status


class _PublisherState:
    """What both publishers keep: the node, its lease, the last batch's sequence number."""

    def __init__(self, client, info: pb.NodeInfo, snapshot_fn: SnapshotFn,
                 lease_ttl_s: int = 0) -> None:
        self.client = client
        self.info = info
        self.snapshot_fn = snapshot_fn
        self.requested_ttl_s = lease_ttl_s
        self.lease_ttl_s = 0
        self.seq = 0
        self.num_resyncs = 0
        # the proof of our registration (kept in memory only): lets us register our id again
        # with changed addresses while that registration lives (metadata_service.identities)
        self.proof = b""

    def registered(self, reply: pb.RegisterReply) -> None:
        self.lease_ttl_s = reply.lease_ttl_s
        if reply.registration_secret:
            self.proof = reply.registration_secret

    @property
    def node_id(self) -> str:
        return self.info.node_id


class NodePublisher(_PublisherState):
    client: MetadataClient

    def register(self) -> None:
        reply = self.client.register(self.info, self.requested_ttl_s, self.proof)
        self.registered(reply)
        if reply.last_seq != self.seq:
            self.resync()

    def publish(self, events: Iterable[KVEvent]) -> int:
        """Send one batch; returns the reply status (after any resync it triggered)."""
        self.seq += 1
        reply = self.client.publish(self.node_id, self.info.epoch, self.seq, events)
        if reply.status == Status.RESYNC_NEEDED:
            self.resync()
        elif reply.status == Status.UNKNOWN_NODE:
            self.register()
        return reply.status

    def resync(self) -> None:
        logger.info("node %s: sending a snapshot at seq %d", self.node_id, self.seq)
        self.num_resyncs += 1
        self.client.snapshot(self.node_id, self.info.epoch, self.seq, self.snapshot_fn())

    def heartbeat(self) -> bool:
        """True if the lease was alive; otherwise the node has registered again."""
        if self.client.heartbeat(self.node_id, self.info.epoch, self.info.draining):
            return True
        self.register()
        return False

    def deregister(self) -> None:
        self.client.deregister(self.node_id, self.proof)


class AsyncNodePublisher(_PublisherState):
    """``NodePublisher`` for asyncio nodes (same protocol)."""

    client: AsyncMetadataClient

    async def register(self) -> None:
        reply = await self.client.register(self.info, self.requested_ttl_s, self.proof)
        self.registered(reply)
        if reply.last_seq != self.seq:
            await self.resync()

    async def publish(self, events: Iterable[KVEvent]) -> int:
        self.seq += 1
        reply = await self.client.publish(self.node_id, self.info.epoch, self.seq, events)
        if reply.status == Status.RESYNC_NEEDED:
            await self.resync()
        elif reply.status == Status.UNKNOWN_NODE:
            await self.register()
        return reply.status

    async def resync(self) -> None:
        self.num_resyncs += 1
        await self.client.snapshot(self.node_id, self.info.epoch, self.seq, self.snapshot_fn())

    async def heartbeat(self) -> bool:
        if await self.client.heartbeat(self.node_id, self.info.epoch, self.info.draining):
            return True
        await self.register()
        return False

    async def deregister(self) -> None:
        await self.client.deregister(self.node_id, self.proof)
