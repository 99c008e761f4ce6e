"""How the metadata service lays its state out in etcd, and how it reads it back.

Keys, under the configured prefix P (every key of a node is attached to the node's lease, so
a lease expiry deletes the node and all of its persisted blocks at once):

    P/nodes/<node_id>                          msgpack {info: NodeInfo bytes, lease, ttl, proof,
                                               w}; or a tombstone {gone: epoch, w} just
                                               before a deregistration revokes the lease
    P/blocks/<node_id>/state                   msgpack {g: base generation, n: chunks, e, s, w}
    P/blocks/<node_id>/base/<gen>/<chunk>      packed hashes (<= CHUNK_HASHES per chunk)
    P/blocks/<node_id>/delta/<writer>/<n>      msgpack Delta (coalesced changes of one flush)
    P/clients/<client_id>                      a router's pb.ClientKey, under its own lease

A node record carries ``proof``, the hash of its registration's proof
(metadata_service.identities), so every replica enforces it.

A node's block set = the chunks of the generation ``state`` names, then every delta in etcd
revision order. Compaction writes a new base generation, then in one transaction points
``state`` at it and deletes all deltas and older generations.

API: ``Keys``, ``load_states`` (a ``Loaded``), ``NodeRecord``, ``OwnedNode``, ``services``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import etcd3aio
from etcd3aio.kv import KVService
from etcd3aio.lease import LeaseService
from etcd3aio.watch import WatchService

from pdcluster.core.types import NodeId
from pdcluster.metadata_service.codec import Delta, decode_delta, decode_record, unpack_hashes
from pdcluster.metadata_service.store import NodeState
from pdcluster.proto import metadata_pb2 as pb

CHUNK_HASHES = 16384  # 512 KiB of sha256 hashes: well under etcd's 1.5 MiB request limit
PAGE_KEYS = 64


class Keys:
    def __init__(self, prefix: str) -> None:
        self.root = f"{prefix}/".encode()
        self.nodes = f"{prefix}/nodes/".encode()
        self.blocks = f"{prefix}/blocks/".encode()
        self.clients = f"{prefix}/clients/".encode()
        self.health = f"{prefix}/health".encode()

    def node(self, node_id: NodeId) -> bytes:
        return self.nodes + node_id.encode()

    def client(self, client_id: str) -> bytes:
        return self.clients + client_id.encode()

    def node_blocks(self, node_id: NodeId) -> bytes:
        return self.blocks + node_id.encode() + b"/"

    def state(self, node_id: NodeId) -> bytes:
        return self.node_blocks(node_id) + b"state"

    def base_prefix(self, node_id: NodeId) -> bytes:
        return self.node_blocks(node_id) + b"base/"

    def base(self, node_id: NodeId, gen: int, chunk: int | None = None) -> bytes:
        key = self.base_prefix(node_id) + f"{gen:020d}/".encode()
        return key if chunk is None else key + f"{chunk:06d}".encode()

    def delta_prefix(self, node_id: NodeId) -> bytes:
        return self.node_blocks(node_id) + b"delta/"

    def delta(self, node_id: NodeId, writer: str, counter: int) -> bytes:
        return self.delta_prefix(node_id) + f"{writer}/{counter:012d}".encode()

    def parse(self, key: bytes) -> tuple[str, NodeId, list[str]]:
        """(kind, id, rest): kind is 'node', 'client' (id: the client's), 'state', 'base',
        'delta' or 'other'."""
        if key.startswith(self.nodes):
            return "node", key[len(self.nodes):].decode(), []
        if key.startswith(self.clients):
            return "client", key[len(self.clients):].decode(), []
        if key.startswith(self.blocks):
            node_id, _, rest = key[len(self.blocks):].decode().partition("/")
            parts = rest.split("/")
            if parts[0] in ("state", "base", "delta"):
                return parts[0], node_id, parts[1:]
        return "other", "", []


@dataclass(slots=True)
class NodeRecord:
    """A node's registration as stored in etcd."""

    info: pb.NodeInfo
    lease_id: int
    lease_ttl_s: int
    raw: bytes
    proof_hash: bytes = b""

    @classmethod
    def decode(cls, raw: bytes) -> tuple[NodeRecord, str]:
        fields = decode_record(raw)
        info = pb.NodeInfo.FromString(fields["info"])
        return (cls(info, fields["lease"], fields["ttl"], raw, fields.get("proof", b"")),
                fields["w"])


@dataclass(slots=True)
class OwnedNode:
    """A node whose changes this replica persists: its lease, and what is still to write."""

    lease_id: int
    lease_ttl_s: int
    info: pb.NodeInfo | None = None
    proof_hash: bytes = b""
    record_dirty: bool = False  # the registration is still to write
    pending: Delta = field(default_factory=Delta)
    dirty: bool = False
    needs_full: bool = False
    num_deltas: int = 0
    last_flush: float = 0.0
    last_keepalive: float = 0.0


def services(client: etcd3aio.Etcd3Client) -> tuple[KVService, LeaseService, WatchService]:
    """The client's KV, lease and watch services. etcd3aio holds None there before `connect`
    and after `close`: that is `EtcdConnectionError`, which the store treats as etcd down."""
    kv, lease, watch = client.kv, client.lease, client.watch
    if kv is None or lease is None or watch is None:
        raise etcd3aio.EtcdConnectionError("the etcd client is not connected")
    return kv, lease, watch


async def _range_all(
    client: etcd3aio.Etcd3Client, prefix: bytes, timeout_s: float
) -> tuple[list, int]:
    """Every key-value under ``prefix`` at one revision, paged; and that revision."""
    end = etcd3aio.prefix_range_end(prefix)
    start, revision, kvs = prefix, 0, []
    while True:
        reply = await services(client)[0].get(start, end, revision=revision, limit=PAGE_KEYS,
                                              timeout=timeout_s)
        revision = revision or reply.header.revision
        kvs.extend(reply.kvs)
        if not reply.more or not reply.kvs:
            return kvs, revision
        start = reply.kvs[-1].key + b"\x00"


@dataclass(slots=True)
class Loaded:
    """What etcd holds under the prefix at one revision."""

    states: list[NodeState]  # every registered node with its exact persisted block set
    records: dict[NodeId, NodeRecord]
    clients: list[pb.ClientKey]  # routers' keys
    revision: int


async def load_states(
    client: etcd3aio.Etcd3Client, keys: Keys, hash_size: int, timeout_s: float
) -> Loaded:
    kvs, revision = await _range_all(client, keys.root, timeout_s)
    records: dict[NodeId, NodeRecord] = {}
    clients: list[pb.ClientKey] = []
    state_of: dict[NodeId, dict] = {}
    chunks: dict[tuple[NodeId, int], dict[int, bytes]] = defaultdict(dict)
    deltas: dict[NodeId, list[tuple[int, bytes]]] = defaultdict(list)
    for kv in kvs:
        kind, node_id, rest = keys.parse(kv.key)
        if kind == "node" and "gone" not in decode_record(kv.value):  # not a tombstone
            records[node_id] = NodeRecord.decode(kv.value)[0]
        elif kind == "client":
            clients.append(pb.ClientKey.FromString(decode_record(kv.value)["key"]))
        elif kind == "state":
            state_of[node_id] = decode_record(kv.value)
        elif kind == "base" and len(rest) == 2:
            chunks[(node_id, int(rest[0]))][int(rest[1])] = kv.value
        elif kind == "delta":
            deltas[node_id].append((kv.mod_revision, kv.value))
    states = []
    for node_id, record in records.items():
        state = NodeState(record.info, record.lease_ttl_s, epoch=record.info.epoch,
                          proof_hash=record.proof_hash)
        base = state_of.get(node_id)
        if base is not None:
            parts = chunks.get((node_id, base["g"]), {})
            for i in range(base["n"]):
                state.block_hashes.update(unpack_hashes(parts[i], hash_size))
            state.epoch, state.seq = base["e"], base["s"]
        for _, raw in sorted(deltas.get(node_id, ())):
            delta, _ = decode_delta(raw, hash_size)
            delta.apply_to(state.block_hashes)
            state.epoch, state.seq = delta.epoch, delta.seq
        states.append(state)
    return Loaded(states, records, clients, revision)
