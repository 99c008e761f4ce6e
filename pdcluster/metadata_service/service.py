"""The metadata service's logic, independent of gRPC: registry, leases, sequenced block events,
snapshots (resync), prefix queries and stats, over one ``BlockIndex`` and one ``IndexStore``.

Ownership: every method runs on one asyncio event loop (the gRPC server's), which owns the
index; nothing here blocks or awaits on the ingest or query path, so there are no locks.

Sequencing: a node registers with a random ``epoch`` and publishes batches numbered 1, 2, ...
A batch is applied only if it carries the node's epoch and exactly ``last_seq + 1``; an
older seq is a DUPLICATE (ignored, so retransmission is safe); a newer one (a gap, e.g. a
lost or rejected batch) or another epoch answers RESYNC_NEEDED, and the node then sends a
Snapshot of its whole block set as of its latest seq, which replaces what the index held.
A batch is validated whole before any of it is applied: a malformed or oversize one is
rejected (``InvalidBatch``), counted by reason, and leaves a gap that forces a resync.

Leases: with the memory backend a sweeper drops nodes whose deadline passed; with etcd, etcd
expires them and its watch reports the deletes. A sweep that runs late (``stall.StallClock``)
means the process itself stalled (SIGSTOP, a frozen VM): every deadline moves by the stall
first (``forgive_stall``), so a live node is never dropped for heartbeats the service could
not read; and an etcd delete of a node whose (forgiven) deadline is still well ahead — etcd
expired its lease while this replica stood still — writes the node back instead.

API: ``MetadataService``, ``PublishStatus``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

from pdcluster.core.types import NodeId
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.errors import InvalidBatch
from pdcluster.metadata_service.events import (
    Change,
    Op,
    check_node_info,
    decode_events,
    unpack_query,
    unpack_snapshot,
)
from pdcluster.metadata_service.identities import (
    ClientKeys,
    check_allowed,
    check_count,
    check_proof,
    check_unique,
    identity_changed,
    new_proof,
    proof_hash,
)
from pdcluster.metadata_service.replica_sink import NodeEntry, ReplicaSink
from pdcluster.metadata_service.stall import StallClock
from pdcluster.metadata_service.store import IndexStore
from pdcluster.metadata_service.watch import NodeWatch, WatchedIndex
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)

PublishStatus = pb.PublishReply.Status
T = TypeVar("T")


class MetadataService(ReplicaSink):
    def __init__(
        self,
        config: MetadataConfig,
        store: IndexStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.store = store
        self.index = WatchedIndex(config.hash_size, config.watch_max_pending_hashes)
        self.node_watch = NodeWatch()
        self._clock = clock
        self._nodes: dict[NodeId, NodeEntry] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._stall = StallClock(config.sweep_interval_s, clock, self.forgive_stall)
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.clients = ClientKeys(clock=clock)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        states = await self.store.start(self)
        for state in states:
            self._install(state)
        if states:
            logger.info("rebuilt the index from %s: %d nodes, %d blocks", self.store.name,
                        len(states), self.index.num_blocks)
        self._stall.restart()
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="lease-sweeper")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await self.store.close()

    # -- registry --------------------------------------------------------------------------

    def register(self, info: pb.NodeInfo, lease_ttl_s: int) -> tuple[int, int]:
        """Register or refresh a node; returns (granted TTL, last applied seq)."""
        ttl, seq, _ = self.register_node(info, lease_ttl_s)
        return ttl, seq

    def register_node(self, info: pb.NodeInfo, lease_ttl_s: int, proof: bytes = b""
                      ) -> tuple[int, int, bytes]:
        """`register`, guarded (metadata_service.identities): a live registration of the id
        changes only with its `proof`, and no two live nodes share a key, address or
        session. Returns (TTL, last seq, registration secret or b"" for an unchanged
        refresh); raises `RegistrationConflict`. A changed registration is a new incarnation:
        the index drops the node's blocks (watchers see it removed), as for a restart."""
        self._checked(info.node_id, check_node_info, info)
        check_allowed(info, self.config.node_allowlist)
        ttl = self.config.clamp_ttl(lease_ttl_s)
        node = self._nodes.get(info.node_id)
        live = None if node is None else node.info
        changed = live is not None and identity_changed(live, info)
        if changed:
            assert node is not None, "a changed registration has a live node"
            check_proof(live, node.proof_hash, proof, "changing its epoch, key or address")
        check_unique(info, (n.info for n in self._nodes.values()), self.clients.public_keys())
        if node is None:
            check_count(info, (n.info for n in self._nodes.values()), self.config.max_nodes)
        secret = new_proof(live, info)
        if node is None:
            node = self._nodes[info.node_id] = NodeEntry(pb.NodeInfo(), ttl, info.epoch)
            self.index.add_node(info.node_id)
        elif changed:
            logger.info("node %s registered anew (epoch, key or address changed): dropping "
                        "its blocks", info.node_id)
            self._new_incarnation(node, info.epoch)
        if secret is not None:
            node.proof_hash = proof_hash(secret)
        node.info.CopyFrom(info)
        node.lease_ttl_s = ttl
        self._touch(node)
        self.store.node_up(node.info, ttl, changed, node.proof_hash)
        self.node_watch.notify(pb.NodeChange.UP, node.info)
        return ttl, node.seq, secret or b""

    def _new_incarnation(self, node: NodeEntry, epoch: int) -> None:
        """Forget everything the index and its watchers hold for the node's previous
        incarnation: a router drops its attestations and its link on the removal."""
        node_id = node.info.node_id
        self.node_watch.notify(pb.NodeChange.DOWN, node.info)
        self.index.remove_node(node_id)
        self.index.add_node(node_id)
        node.epoch, node.seq = epoch, 0

    def release_node(self, node_id: NodeId) -> bool:
        """An operator's action: forget the id's registration (and its blocks), so that a
        new key may register it at once. False if it was not registered."""
        released = self._drop(node_id)
        if released:
            self.store.node_down(node_id)
        return released

    def register_client(self, key: pb.ClientKey, lease_ttl_s: int) -> int:
        """A router's key, under a lease (shared with every replica through the store);
        returns the TTL granted. A live node's key is refused (RegistrationConflict)."""
        ttl = self.config.clamp_ttl(lease_ttl_s)
        self.clients.register(key, ttl, (n.info.curve_public_key for n in self._nodes.values()))
        self.store.client_up(key, ttl)
        return ttl

    def heartbeat(self, node_id: NodeId, epoch: int, draining: bool = False) -> bool:
        """Keep the node's lease alive; a change of its drain state goes to the store (the
        other replicas) and the node watchers."""
        node = self._nodes.get(node_id)
        if node is None or node.epoch != epoch:
            return False
        self._touch(node)
        if node.info.draining != draining:
            node.info.draining = draining
            self.store.node_up(node.info, node.lease_ttl_s, False, node.proof_hash)
            self.node_watch.notify(pb.NodeChange.UP, node.info)
        self.store.node_alive(node_id)
        return True

    def deregister(self, node_id: NodeId, proof: bytes = b"") -> None:
        """Drop the node's registration: only the holder of its proof may (RegistrationConflict
        otherwise; an operator's `release_node` needs none)."""
        node = self._nodes.get(node_id)
        if node is not None:
            check_proof(node.info, node.proof_hash, proof, "deregistering it")
        if self._drop(node_id):
            self.store.node_down(node_id)

    def list_nodes(self, role: int = pb.ROLE_UNSPECIFIED) -> list[pb.NodeInfo]:
        return [node.info for node_id, node in sorted(self._nodes.items())
                if role in (pb.ROLE_UNSPECIFIED, node.info.role)]

    # -- block events ----------------------------------------------------------------------

    def publish(
        self, node_id: NodeId, epoch: int, seq: int, events: Sequence[pb.KVEventMsg]
    ) -> tuple[pb.PublishReply.Status, int]:
        """Apply one batch; returns (PublishStatus, last applied seq)."""
        ops = self._checked(node_id, decode_events, events, self.config)
        node = self._nodes.get(node_id)
        if node is None:
            return PublishStatus.UNKNOWN_NODE, 0
        if epoch != node.epoch or seq > node.seq + 1:
            self.counters["resyncs_requested"] += 1
            return PublishStatus.RESYNC_NEEDED, node.seq
        if seq <= node.seq:
            return PublishStatus.DUPLICATE, node.seq
        self._checked(node_id, self._check_capacity, node, ops)
        self._apply(node_id, ops)
        node.seq = seq
        self.store.position(node_id, epoch, seq)
        self.counters["batches_ingested"] += 1
        return PublishStatus.OK, seq

    def snapshot(self, node_id: NodeId, epoch: int, seq: int, packed: bytes,
                 media: bytes = b"") -> int:
        """Replace the node's block set (and its blocks' media) with a full snapshot as of
        ``seq``."""
        block_hashes, lower = self._checked(node_id, unpack_snapshot, packed, self.config,
                                            media)
        node = self._nodes.get(node_id)
        if node is None or node.epoch != epoch:
            self._reject(node_id, InvalidBatch(
                "unknown_node", f"snapshot from {node_id} epoch {epoch}: not registered with "
                "that epoch; register first"))
        cap = self.config.node_block_cap(node.info.capacity_blocks)
        if len(block_hashes) > cap:
            self._reject(node_id, InvalidBatch(
                "over_capacity", f"snapshot of {len(block_hashes)} blocks from {node_id}: "
                f"more than the {cap} it may hold (its declared capacity_blocks "
                f"{node.info.capacity_blocks} x {self.config.node_capacity_factor}, at most "
                f"max_node_blocks {self.config.max_node_blocks})"))
        self.index.replace_node_blocks(node_id, block_hashes, lower)
        node.seq = seq
        self.store.blocks_cleared(node_id)
        self.store.blocks_stored(node_id, block_hashes)
        self.store.position(node_id, epoch, seq)
        self.counters["snapshots_applied"] += 1
        return seq

    def _check_capacity(self, node: NodeEntry, changes: list[Change]) -> None:
        """Refuse a batch that would leave the node holding more blocks than it may (its
        removals in the batch are not counted: a node at its cap frees before it stores)."""
        node_id = node.info.node_id
        cap = self.config.node_block_cap(node.info.capacity_blocks)
        cleared = max((i for i, c in enumerate(changes) if c.op is Op.CLEARED), default=-1)
        held = 0 if cleared >= 0 else self.index.num_node_blocks(node_id)
        stores = [c for c in changes[cleared + 1:] if c.op is Op.STORED or c.op is Op.MOVED]
        if held + sum(len(c.block_hashes) for c in stores) <= cap:
            return
        holds = self.index.holds if cleared < 0 else (lambda _n, _h: False)
        new = {h for c in stores for h in c.block_hashes if not holds(node_id, h)}
        if held + len(new) > cap:
            raise InvalidBatch("over_capacity", f"node {node_id} would hold {held + len(new)} "
                               f"blocks, more than the {cap} it may (declared capacity_blocks "
                               f"{node.info.capacity_blocks} x "
                               f"{self.config.node_capacity_factor}, at most max_node_blocks "
                               f"{self.config.max_node_blocks})")

    def _apply(self, node_id: NodeId, changes: list[Change]) -> None:
        """Apply to the index; the store keeps membership only (which blocks a node holds on
        any medium), so a removal of one copy reaches it only for blocks left with none."""
        index, store = self.index, self.store
        num_events = 0
        for change in changes:
            op, block_hashes = change.op, change.block_hashes
            if op is Op.STORED or op is Op.MOVED:
                if op is Op.STORED:
                    index.add_blocks(node_id, block_hashes, change.medium or "device")
                else:
                    assert change.src and change.medium, "a decoded move names both media"
                    index.move_blocks(node_id, block_hashes, change.src, change.medium)
                store.blocks_stored(node_id, block_hashes)
            elif op is Op.REMOVED:
                index.remove_blocks(node_id, block_hashes, change.medium)
                gone = block_hashes if change.medium is None else \
                    [h for h in block_hashes if not index.holds(node_id, h)]
                store.blocks_removed(node_id, gone)
            else:
                index.clear_node(node_id)
                store.blocks_cleared(node_id)
            num_events += max(1, len(block_hashes))
        self.counters["events_ingested"] += num_events

    def _checked(self, node_id: NodeId, check: Callable[..., T], *args: Any) -> T:
        try:
            return check(*args)
        except InvalidBatch as exc:
            self._reject(node_id, exc)
            raise

    def _reject(self, node_id: NodeId, exc: InvalidBatch) -> NoReturn:
        self.rejected[exc.reason] += 1
        logger.debug("rejected a request from %s: %s", node_id, exc)
        raise exc

    # -- queries ---------------------------------------------------------------------------

    def query(
        self,
        packed: bytes,
        role: int = pb.ROLE_UNSPECIFIED,
        node_ids: Sequence[NodeId] = (),
        include_zero: bool = False,
    ) -> list[tuple[NodeId, int]]:
        return [(n, k) for n, k, _, _ in self.query_tiers(packed, role, node_ids, include_zero)]

    def query_tiers(
        self,
        packed: bytes,
        role: int = pb.ROLE_UNSPECIFIED,
        node_ids: Sequence[NodeId] = (),
        include_zero: bool = False,
    ) -> list[tuple[NodeId, int, int, int]]:
        """(node, leading blocks held, how many of them only on its host, only on disk)."""
        chain = self._checked("query", unpack_query, packed, self.config)
        self.counters["queries"] += 1
        candidates: Sequence[NodeId] | None = None
        if role != pb.ROLE_UNSPECIFIED or node_ids:
            pool = node_ids or self._nodes.keys()
            candidates = [n for n in pool if (node := self._nodes.get(n)) is not None
                          and role in (pb.ROLE_UNSPECIFIED, node.info.role)]
        index = self.index
        return [(n, k, *index.lower_tiers(n, chain[:k]))
                for n, k in index.query(chain, candidates, include_zero)]

    def stats(self) -> pb.StatsReply:
        store = self.store
        return pb.StatsReply(
            num_nodes=len(self._nodes),
            num_blocks=self.index.num_blocks,
            num_entries=self.index.num_entries,
            events_ingested=self.counters["events_ingested"],
            batches_ingested=self.counters["batches_ingested"],
            batches_rejected=sum(self.rejected.values()),
            rejected_by_reason=dict(self.rejected),
            resyncs_requested=self.counters["resyncs_requested"],
            snapshots_applied=self.counters["snapshots_applied"],
            queries=self.counters["queries"],
            backend=store.name,
            healthy=store.healthy,
            etcd_status=store.status,
            persistence_pending_nodes=store.num_pending_nodes,
            etcd_writes=store.num_writes,
            persistence_policy=store.persistence_policy,
            block_watchers=len(self.index.subscribers),
            block_watchers_cut=self.index.num_cut,
        )

    def _touch(self, node: NodeEntry) -> None:
        node.deadline = self._clock() + node.lease_ttl_s

    def _drop(self, node_id: NodeId) -> bool:
        node = self._nodes.pop(node_id, None)  # the id is free: the next key takes it
        if node is None:
            return False
        self.index.remove_node(node_id)
        self.node_watch.notify(pb.NodeChange.DOWN, node.info)
        return True

    def expire_leases(self) -> list[NodeId]:
        """Drop every node whose lease deadline passed (memory backend); returns them."""
        now = self._clock()
        expired = [n for n, node in self._nodes.items()
                   if node.deadline is not None and node.deadline <= now]
        for node_id in expired:
            logger.info("node %s: lease expired, dropping it and its blocks", node_id)
            self._drop(node_id)
            self.store.node_down(node_id)
        return expired

    def forgive_stall(self, stalled_s: float) -> None:
        """This process did not run for `stalled_s` (stopped, starved, suspended): no node
        could renew its lease meanwhile, so every deadline moves that much later. Without
        it, a service stalled past the TTL would drop every live node's blocks at once the
        moment it resumed, before it read the heartbeats queued for it."""
        logger.warning("the service stalled for %.1f s: extending %d leases by as much",
                       stalled_s, len(self._nodes))
        for node in self._nodes.values():
            if node.deadline is not None:
                node.deadline += stalled_s

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            self._stall.tick()
            if self.store.expires_leases_locally:
                self.expire_leases()

