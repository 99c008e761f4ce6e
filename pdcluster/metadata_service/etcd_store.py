"""The etcd backend: durable registry (leases), batched block-set persistence, replica sync.

Client: ``etcd3aio`` (asyncio over grpc.aio, maintained, leases/watch/txn; one etcd client
library per process: their generated protobufs collide).

Writes: the service's calls only record changes in memory (a coalesced ``Delta`` per node).
One background loop writes each dirty node at most once per ``flush_interval_s`` (one put of
the delta; every ``compact_after_deltas`` flushes, or after a clear/snapshot, a full base
rewrite instead), so the etcd write rate per node is bounded whatever the event rate.

Failure: any etcd error marks the store unhealthy (the service reports degraded health and
keeps serving from memory). Changes keep QUEUEING, coalesced per node, so the queue is bounded
by the nodes' block sets, not by the event count. A probe runs every ``health_interval_s``;
when etcd answers again the store reconciles: reloads etcd's view (other replicas' nodes),
re-grants leases that expired meanwhile (rewriting those nodes in full), restarts the watch,
and flushes the queue.

Access: TLS and etcd's auth come from ``etcd_access`` (a user confined to the prefix). A refused
password at start is ``EtcdAccessError`` (the service does not start); later, the store logs in
again every ``etcd_reauth_interval_s`` and before each probe while etcd is down.

Replicas: each watches the whole prefix and applies other writers' node records and deltas.
Lease expiry deletes a node's keys; the watch turns that into ``remote_node_down`` everywhere.

API: ``EtcdIndexStore``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Iterable

import etcd3aio
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService

from pdcluster.core.types import BlockHash, NodeId
from pdcluster.metadata_service.codec import Delta, encode_delta, encode_record, pack_hashes
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.etcd_access import EtcdAccessError, authenticate, make_client
from pdcluster.metadata_service.etcd_clients import ClientLeases
from pdcluster.metadata_service.etcd_layout import (
    CHUNK_HASHES,
    Keys,
    NodeRecord,
    OwnedNode,
    load_states,
    services,
)
from pdcluster.metadata_service.etcd_watch import ETCD_ERRORS as _ETCD_ERRORS
from pdcluster.metadata_service.etcd_watch import ReplicaWatch
from pdcluster.metadata_service.store import IndexStore, NodeState, StoreSink
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)



class EtcdIndexStore(ReplicaWatch, ClientLeases, IndexStore):
    name = "etcd"
    persistence_policy = ("queue: changes are coalesced per node and written when etcd "
                          "returns (memory bounded by the nodes' block sets)")
    expires_leases_locally = False

    def __init__(self, config: MetadataConfig) -> None:
        self._config = config
        self._keys = Keys(config.etcd_prefix)
        self._writer = config.replica_id or secrets.token_hex(6)
        self._client = make_client(
            config.etcd_endpoints, config.etcd_tls, rpc_max_attempts=1,
            watch_reconnect_backoff_seconds=0.2, watch_max_reconnect_backoff_seconds=1.0)
        self._last_auth = 0.0
        # Private hook: etcd3aio has no public channel options. Large pages on reload, and a
        # quick reconnect after an etcd restart (gRPC's default backoff grows to minutes).
        self._client._manager.grpc_options.extend([
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self._sink: StoreSink | None = None
        self._owned: dict[NodeId, OwnedNode] = {}
        self._records: dict[NodeId, NodeRecord] = {}
        self._clients = {}
        self._revokes: dict[int, tuple[NodeId, int]] = {}  # lease -> (node, epoch) that left
        self._healthy = False
        self._status = "connecting"
        self._writes = 0
        self._counter = 0
        self._loop_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._base_chunks: dict[tuple[NodeId, int], dict[int, bytes]] = {}

    # -- IndexStore: lifecycle and health --------------------------------------------------

    async def start(self, sink: StoreSink) -> list[NodeState]:
        self._sink = sink
        await self._client.connect()
        states: list[NodeState] = []
        try:
            await self._login()
            states = await self._reload()
        except _ETCD_ERRORS as exc:
            self._mark_down(exc)
        except EtcdAccessError:  # a refused password: the service does not start
            await self._client.close()
            raise
        self._loop_task = asyncio.create_task(self._run(), name="etcd-store")
        return states

    async def close(self) -> None:
        if self._healthy:
            with contextlib.suppress(*_ETCD_ERRORS):
                await asyncio.wait_for(self._flush(force=True), self._config.etcd_timeout_s * 4)
        for task in (self._loop_task, self._watch_task, *self._background):
            if task is not None:
                task.cancel()
        await self._client.close()

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def status(self) -> str:
        return self._status

    @property
    def num_pending_nodes(self) -> int:
        return sum(1 for o in self._owned.values()
                   if o.dirty or o.needs_full or o.record_dirty or not o.lease_id)

    @property
    def num_writes(self) -> int:
        return self._writes

    # -- IndexStore: recording changes (synchronous, never blocks) -------------------------

    def node_up(self, info: pb.NodeInfo, lease_ttl_s: int, restarted: bool,
                proof_hash: bytes = b"") -> None:
        owned = self._own(info.node_id, lease_ttl_s)
        owned.info, owned.proof_hash, owned.record_dirty = info, proof_hash, True
        if restarted:
            owned.pending.clear()
            owned.pending.epoch, owned.pending.seq = info.epoch, 0
            owned.dirty = True

    def node_alive(self, node_id: NodeId) -> None:
        owned = self._own(node_id)
        now = time.monotonic()
        if self._healthy and owned.lease_id and now - owned.last_keepalive >= owned.lease_ttl_s / 4:
            owned.last_keepalive = now
            self._spawn(self._keepalive(owned.lease_id))

    def node_down(self, node_id: NodeId) -> None:
        """Deregistered or released here: a tombstone naming the epoch that left tells the
        other replicas so (a bare delete looks like a lease that expired while they stalled,
        which the replica serving the node would write back), then the lease goes."""
        owned = self._owned.pop(node_id, None)
        record = self._records.pop(node_id, None)
        lease_id = owned.lease_id if owned else record.lease_id if record else 0
        info = owned.info if owned and owned.info else record.info if record else None
        if lease_id:
            self._revokes[lease_id] = (node_id, info.epoch if info is not None else 0)

    def blocks_stored(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        owned = self._own(node_id)
        owned.pending.add(block_hashes)
        owned.dirty = True

    def blocks_removed(self, node_id: NodeId, block_hashes: Iterable[BlockHash]) -> None:
        owned = self._own(node_id)
        owned.pending.remove(block_hashes)
        owned.dirty = True

    def blocks_cleared(self, node_id: NodeId) -> None:
        owned = self._own(node_id)
        owned.pending.clear()
        owned.dirty = True

    def position(self, node_id: NodeId, epoch: int, seq: int) -> None:
        owned = self._own(node_id)
        owned.pending.epoch, owned.pending.seq = epoch, seq
        owned.dirty = True

    def _own(self, node_id: NodeId, lease_ttl_s: int = 0) -> OwnedNode:
        owned = self._owned.get(node_id)
        if owned is None:
            record = self._records.get(node_id)
            if record is not None:
                owned = OwnedNode(record.lease_id, record.lease_ttl_s, record.info,
                                  record.proof_hash)
            else:
                owned = OwnedNode(0, lease_ttl_s or self._config.default_lease_ttl_s)
            self._owned[node_id] = owned
        return owned

    # -- background work -------------------------------------------------------------------

    async def _run(self) -> None:
        tick = min(self._config.flush_interval_s, self._config.health_interval_s) / 2
        last_probe = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                now = time.monotonic()
                # down: log in again before probing (a restarted etcd forgot the token), but
                # at most once per health interval (etcd checks a password with bcrypt)
                relogin = (self._config.health_interval_s if not self._healthy
                           else self._config.etcd_reauth_interval_s)
                if now - self._last_auth >= relogin:
                    await self._login()
                if not self._healthy or now - last_probe >= self._config.health_interval_s:
                    last_probe = now
                    await self._kv.get(self._keys.health, timeout=self._config.etcd_timeout_s)
                    if not self._healthy:
                        await self._reconcile()
                await self._flush(force=False)
            except (*_ETCD_ERRORS, EtcdAccessError) as exc:
                self._mark_down(exc)

    async def _login(self) -> None:
        """Authenticate as the configured etcd user (nothing without one)."""
        config = self._config
        self._last_auth = time.monotonic()
        if config.etcd_user is not None and config.etcd_password is not None:
            await authenticate(self._client, config.etcd_user, config.etcd_password,
                               config.etcd_timeout_s)

    @property
    def _kv(self) -> KVService:
        return services(self._client)[0]

    @property
    def _lease(self) -> LeaseService:
        return services(self._client)[1]

    def _mark_down(self, exc: BaseException) -> None:
        if self._healthy or self._status == "connecting":
            logger.error("etcd unreachable, serving from memory and queueing writes: %r", exc)
        self._healthy = False
        self._status = f"unreachable: {type(exc).__name__}"
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None

    async def _reconcile(self) -> None:
        for owned in self._owned.values():
            if owned.lease_id:
                reply = await self._lease.time_to_live(
                    owned.lease_id, timeout=self._config.etcd_timeout_s)
                if reply.TTL <= 0:
                    owned.lease_id = 0
        states = await self._reload()
        assert self._sink is not None, "store not started"
        self._sink.remote_reload(states)
        logger.info("etcd reachable again: reconciled %d nodes", len(states))

    async def _reload(self) -> list[NodeState]:
        loaded = await load_states(
            self._client, self._keys, self._config.hash_size, self._config.etcd_timeout_s * 10)
        self._records = loaded.records
        assert self._sink is not None, "store not started"
        for key in loaded.clients:
            self._sink.remote_client_up(key)
        self._watch_task = asyncio.create_task(self._watch(loaded.revision + 1),
                                               name="etcd-watch")
        self._healthy, self._status = True, "ok"
        return loaded.states

    async def _flush(self, force: bool) -> None:
        timeout = self._config.etcd_timeout_s
        for lease_id, (node_id, epoch) in list(self._revokes.items()):
            with contextlib.suppress(etcd3aio.EtcdError):  # already expired: nothing to revoke
                await self._kv.put(self._keys.node(node_id), encode_record(
                    {"gone": epoch, "w": self._writer}), lease=lease_id, timeout=timeout)
                await self._lease.revoke(lease_id, timeout=timeout)
            del self._revokes[lease_id]
        now = time.monotonic()
        due = [(node_id, owned) for node_id, owned in self._owned.items()
               if (owned.dirty or owned.needs_full or owned.record_dirty or not owned.lease_id)
               and (force or now - owned.last_flush >= self._config.flush_interval_s)]
        await self._flush_clients()
        results = await asyncio.gather(*(self._flush_node(n, o) for n, o in due),
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _flush_node(self, node_id: NodeId, owned: OwnedNode) -> None:
        timeout = self._config.etcd_timeout_s
        owned.last_flush = time.monotonic()
        if not owned.lease_id:
            lease = await self._lease.grant(owned.lease_ttl_s, timeout=timeout)
            owned.lease_id, owned.needs_full, owned.record_dirty = lease.ID, True, True
        if owned.record_dirty and owned.info is not None:
            owned.record_dirty = False
            try:
                await self._put(self._keys.node(node_id), encode_record({
                    "info": owned.info.SerializeToString(), "lease": owned.lease_id,
                    "ttl": owned.lease_ttl_s, "proof": owned.proof_hash, "w": self._writer}),
                    owned)
            except BaseException:
                owned.record_dirty = True
                raise
        if owned.needs_full or owned.pending.cleared or (
                owned.dirty and owned.num_deltas >= self._config.compact_after_deltas):
            await self._write_base(node_id, owned)
        elif owned.dirty:
            delta, owned.pending, owned.dirty = owned.pending, Delta(), False
            self._counter += 1
            key = self._keys.delta(node_id, self._writer, self._counter)
            try:
                await self._put(key, encode_delta(delta, self._writer), owned)
            except BaseException:
                owned.needs_full = True  # the lost delta is folded into a full rewrite
                raise
            owned.num_deltas += 1

    async def _write_base(self, node_id: NodeId, owned: OwnedNode) -> None:
        assert self._sink is not None, "store not started"
        snapshot = self._sink.node_snapshot(node_id)
        if snapshot is None:
            return
        epoch, seq, block_hashes = snapshot
        owned.pending, owned.dirty, owned.needs_full = Delta(), False, False
        packed = pack_hashes(block_hashes)
        step = CHUNK_HASHES * self._config.hash_size
        chunks = [packed[i:i + step] for i in range(0, len(packed), step)]
        gen = time.time_ns()
        keys, kv = self._keys, self._kv
        try:
            for i, chunk in enumerate(chunks):
                await self._put(keys.base(node_id, gen, i), chunk, owned)
            state = encode_record({"g": gen, "n": len(chunks), "e": epoch, "s": seq,
                                   "w": self._writer})
            await kv.txn([], [
                kv.txn_op_put(keys.state(node_id), state, lease=owned.lease_id),
                kv.txn_op_delete(keys.delta_prefix(node_id),
                                 range_end=etcd3aio.prefix_range_end(keys.delta_prefix(node_id))),
                kv.txn_op_delete(keys.base_prefix(node_id), range_end=keys.base(node_id, gen)),
            ], timeout=self._config.etcd_timeout_s)
            self._writes += 1
        except BaseException:
            owned.needs_full = True
            raise
        owned.num_deltas = 0

    async def _put(self, key: bytes, value: bytes, owned: OwnedNode) -> None:
        await self._kv.put(key, value, lease=owned.lease_id, timeout=self._config.etcd_timeout_s)
        self._writes += 1

    async def _keepalive(self, lease_id: int) -> None:
        stream = self._lease.keep_alive(lease_id)
        try:
            async with asyncio.timeout(self._config.etcd_timeout_s):
                async for reply in stream:
                    if reply.TTL <= 0:
                        logger.info("lease %x expired before its keepalive", lease_id)
                    break
        except _ETCD_ERRORS as exc:
            self._mark_down(exc)
        finally:
            stream.cancel()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
