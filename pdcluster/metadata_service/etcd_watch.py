"""The etcd backend's replica side: apply what other writers and lease expiry change in etcd.

Mixed into ``EtcdIndexStore`` (it uses the store's records, owned nodes, writer id and sink).
A watch over the whole prefix, from the revision the store loaded at, turns node-record puts
into ``remote_node_up``, a deregistration's tombstone into ``remote_node_gone``, deletes
(lease expiry, and the tombstone's own) into ``remote_node_down``,
and other writers' deltas and bases into ``remote_delta``; a base's chunks precede its
``state`` key in revision order, so they are buffered until the ``state`` names them.

API: ``ReplicaWatch``, ``ETCD_ERRORS``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import etcd3aio
import grpc

from pdcluster.core.types import NodeId
from pdcluster.metadata_service.codec import Delta, decode_delta, decode_record, unpack_hashes
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.etcd_layout import Keys, NodeRecord, OwnedNode, services
from pdcluster.metadata_service.store import StoreSink

logger = logging.getLogger(__name__)

ETCD_ERRORS = (etcd3aio.EtcdError, grpc.RpcError, TimeoutError, OSError)
_PUT, _DELETE = 0, 1


class ReplicaWatch:
    """The watch half of ``EtcdIndexStore`` (a mixin: state lives in the store)."""

    # The store's state and the one store method this half uses (EtcdIndexStore sets them).
    _config: MetadataConfig
    _keys: Keys
    _client: etcd3aio.Etcd3Client
    _writer: str
    _sink: StoreSink | None
    _records: dict[NodeId, NodeRecord]
    _owned: dict[NodeId, OwnedNode]
    _base_chunks: dict[tuple[NodeId, int], dict[int, bytes]]
    _mark_down: Callable[[BaseException], None]
    _on_client_event: Callable[[str, int, bytes], None]

    async def _watch(self, start_revision: int) -> None:
        root = self._keys.root
        try:
            async for reply in services(self._client)[2].watch(
                    root, etcd3aio.prefix_range_end(root), start_revision=start_revision):
                for event in reply.events:
                    self._on_event(event)
        except asyncio.CancelledError:
            raise
        except ETCD_ERRORS as exc:
            self._mark_down(exc)

    def _on_event(self, event) -> None:
        assert self._sink is not None, "store not started"
        kind, node_id, rest = self._keys.parse(event.kv.key)
        if kind == "node" and event.type == _PUT and "gone" in (fields := decode_record(
                event.kv.value)):
            self._records.pop(node_id, None)
            self._owned.pop(node_id, None)
            if fields["w"] != self._writer:
                self._sink.remote_node_gone(node_id, fields["gone"])
        elif kind == "node" and event.type == _PUT:
            record, writer = NodeRecord.decode(event.kv.value)
            self._records[node_id] = record
            owned = self._owned.get(node_id)
            if owned is not None and writer != self._writer:
                owned.lease_id = record.lease_id  # another replica (re)granted it
            if writer != self._writer:
                self._sink.remote_node_up(record.info, record.lease_ttl_s, record.proof_hash)
        elif kind == "node" and event.type == _DELETE:
            self._records.pop(node_id, None)
            self._owned.pop(node_id, None)
            self._sink.remote_node_down(node_id)
        elif kind == "client":
            self._on_client_event(node_id, event.type, event.kv.value)
        elif kind == "delta" and event.type == _PUT:
            delta, writer = decode_delta(event.kv.value, self._config.hash_size)
            if writer != self._writer:
                self._sink.remote_delta(node_id, delta)
        elif kind == "base" and event.type == _PUT and len(rest) == 2:
            chunks = self._base_chunks.setdefault((node_id, int(rest[0])), {})
            chunks[int(rest[1])] = event.kv.value
        elif kind == "state" and event.type == _PUT:
            self._on_remote_base(node_id, decode_record(event.kv.value))

    def _on_remote_base(self, node_id: NodeId, state: dict[str, Any]) -> None:
        """A base (full rewrite) landed: its chunks came first in the watch, in revision order."""
        chunks = {k: v for k, v in self._base_chunks.items() if k[0] == node_id}
        for key in chunks:
            del self._base_chunks[key]
        if state["w"] == self._writer:
            return
        parts = chunks.get((node_id, state["g"]), {})
        if len(parts) != state["n"]:
            logger.error("node %s: base %d has %d of %d chunks in the watch; skipped", node_id,
                         state["g"], len(parts), state["n"])
            return
        full = Delta(epoch=state["e"], seq=state["s"], cleared=True)
        for i in range(state["n"]):
            full.added.update(unpack_hashes(parts[i], self._config.hash_size))
        assert self._sink is not None, "store not started"
        self._sink.remote_delta(node_id, full)
