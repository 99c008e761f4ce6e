"""The etcd backend's router keys: each router's `pb.ClientKey` under `P/clients/<client_id>`,
attached to a lease of the router's own TTL, so that every replica admits the routers any
replica registered (a node asking another replica must not refuse a router), and a router
that stops renewing leaves them all when the lease ends.

Mixed into ``EtcdIndexStore`` (it uses the store's keys, client, writer id, sink and its
background-task spawner). A registration here writes the record (granting a lease first) at
the next flush; a renewal keeps the lease alive, at most once per quarter TTL. The watch turns
other writers' puts into ``remote_client_up`` and deletes (lease expiry) into
``remote_client_down``.

API: ``ClientLeases``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import etcd3aio

from pdcluster.metadata_service.codec import decode_record, encode_record
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.etcd_layout import Keys, services
from pdcluster.metadata_service.store import StoreSink
from pdcluster.proto import metadata_pb2 as pb

_PUT = 0


@dataclass(slots=True)
class _OwnedClient:
    key: pb.ClientKey
    lease_ttl_s: int
    lease_id: int = 0
    dirty: bool = True  # the record is still to write
    last_keepalive: float = 0.0


class ClientLeases:
    """The router-key half of ``EtcdIndexStore`` (a mixin: state lives in the store)."""

    _config: MetadataConfig
    _keys: Keys
    _client: etcd3aio.Etcd3Client
    _writer: str
    _sink: StoreSink | None
    _healthy: bool
    _clients: dict[str, _OwnedClient]
    _spawn: Callable[[Coroutine[Any, Any, None]], None]
    _keepalive: Callable[[int], Coroutine[Any, Any, None]]

    def client_up(self, key: pb.ClientKey, lease_ttl_s: int) -> None:
        owned = self._clients.get(key.client_id)
        if owned is None or owned.key != key or owned.lease_ttl_s != lease_ttl_s:
            stored = pb.ClientKey()
            stored.CopyFrom(key)
            self._clients[key.client_id] = _OwnedClient(stored, lease_ttl_s)
            return
        now = time.monotonic()
        if (self._healthy and owned.lease_id and not owned.dirty
                and now - owned.last_keepalive >= owned.lease_ttl_s / 4):
            owned.last_keepalive = now
            self._spawn(self._keepalive(owned.lease_id))

    async def _flush_clients(self) -> None:
        kv, lease = services(self._client)[:2]
        timeout = self._config.etcd_timeout_s
        for client_id, owned in list(self._clients.items()):
            if not owned.dirty:
                continue
            if not owned.lease_id:
                owned.lease_id = (await lease.grant(owned.lease_ttl_s, timeout=timeout)).ID
            record = encode_record({"key": owned.key.SerializeToString(), "w": self._writer})
            await kv.put(self._keys.client(client_id), record, lease=owned.lease_id,
                         timeout=timeout)
            owned.dirty, owned.last_keepalive = False, time.monotonic()

    def _on_client_event(self, client_id: str, event_type: int, value: bytes) -> None:
        assert self._sink is not None, "store not started"
        if event_type == _PUT:
            fields = decode_record(value)
            if fields["w"] != self._writer:
                self._sink.remote_client_up(pb.ClientKey.FromString(fields["key"]))
            return
        # the lease ended: forget ours too (a renewal writes it again, under a new lease)
        self._clients.pop(client_id, None)
        self._sink.remote_client_down(client_id)
