"""Python clients of the metadata service, for nodes and the router: ``MetadataClient`` (sync,
any thread) and ``AsyncMetadataClient`` (asyncio), with the same methods. gRPC failures become
``MetadataUnavailable`` / ``MetadataAuthError`` / ``MetadataRequestError``.

Credentials: ``token=`` (a bearer token, ``ClusterSecret.metadata_token(principal)``, or a
callable returning the current one: a node's ``pod_token.PodTokenSource``, which renews), or
``cluster_secret=`` and ``principal=`` (default ``SERVICE``: read, never act as a node; a node
passes ``node_principal(its id)``). The service refuses a call without one.
TLS: ``tls_ca_file=`` (verify the service), ``tls_server_name=`` (if the address is not in its
certificate), ``tls_cert_file=``/``tls_key_file=`` (present a client certificate: mTLS), or
the same as one ``tls=`` (a ``core.tls.ClientTLS``). ``channel_options=`` adds gRPC channel
options (the router's link sets keepalive). The asyncio client also follows the block index
(``watch_blocks``: the router's mirror); this is the one place each request is built.

Nodes use ``NodePublisher`` (in ``metadata_service.publisher``) on top of a client: it numbers
batches and answers resync requests with snapshots.

API: ``MetadataClient``, ``AsyncMetadataClient``, ``make_node_info``, ``node_identity`` (a
registration's ``core.kv_identity.KVIdentity``), ``role_value``, ``medium_from_pb`` (a
`BlockUpdate`'s medium as ``core.events`` names it, for watchers).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import grpc

from pdcluster.core.credentials import SERVICE, ClusterSecret
from pdcluster.core.events import KVEvent
from pdcluster.core.kv_identity import KVIdentity
from pdcluster.core.roles import NODE_ROLES, Role, role_names
from pdcluster.core.tls import ClientTLS
from pdcluster.core.types import BlockHash, NodeId
from pdcluster.metadata_service.codec import pack_hashes
from pdcluster.metadata_service.errors import (
    MetadataAuthError,
    MetadataError,
    MetadataRequestError,
    MetadataUnavailable,
)
from pdcluster.metadata_service.events import encode_events, medium_from_pb
from pdcluster.metadata_service.wire import AUTH_HEADER, GRPC_OPTIONS
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.proto import metadata_pb2_grpc as pb_grpc

__all__ = ["AsyncMetadataClient", "MetadataClient", "SnapshotBlocks", "TierMatch",
           "make_node_info", "medium_from_pb", "node_identity", "role_value"]

ROLES: dict[str, pb.Role] = {Role.PREFILL: pb.PREFILL, Role.DECODE: pb.DECODE}
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED)

Match = tuple[NodeId, int]
TierMatch = tuple[NodeId, int, int, int]  # node, leading blocks, of them on host, on disk
# A snapshot: the node's hashes, or hash -> media mask (1 device, 2 host, 4 disk)
SnapshotBlocks = Iterable[BlockHash] | Mapping[BlockHash, int]


def role_value(role: str | int | None) -> pb.Role:
    """'prefill' / 'decode' / a ``pb.Role`` value / None (any) -> the wire value."""
    if role is None:
        return pb.ROLE_UNSPECIFIED
    if isinstance(role, str):
        if role not in ROLES:
            raise ValueError(f"role must be one of {role_names(NODE_ROLES)}, got {role!r}")
        return ROLES[role]
    return cast("pb.Role", role)  # a pb.Role value is its int (proto3 enums are open)


def make_node_info(
    node_id: NodeId,
    role: str | int,
    *,
    request_address: str = "",
    kv_address: str = "",
    identity: KVIdentity | None = None,
    capacity_blocks: int = 0,
    epoch: int | None = None,
    metrics_address: str = "",
    curve_public_key: bytes = b"",
    kv_session: str = "",
) -> pb.NodeInfo:
    """A node's registration; ``epoch`` defaults to a fresh random one (a new process).
    Without an ``identity`` the node declares no KV identity: routers send it nothing."""
    info = pb.NodeInfo(
        node_id=node_id, role=role_value(role), request_address=request_address,
        kv_address=kv_address, capacity_blocks=capacity_blocks,
        metrics_address=metrics_address, epoch=secrets.randbits(63) if epoch is None else epoch,
        curve_public_key=curve_public_key.decode(), kv_session=kv_session,
    )
    if identity is not None:
        info.block_size, info.model = identity.block_size, identity.model
        info.hash_algorithm, info.hash_seed = identity.hash_algorithm, identity.hash_seed
        info.tokenizer_digest = identity.tokenizer_digest
    return info


def node_identity(info: pb.NodeInfo) -> KVIdentity:
    """The KV identity a registration declares (empty fields where it declares none)."""
    return KVIdentity(info.block_size, info.hash_algorithm, info.hash_seed, info.model,
                      info.tokenizer_digest)


def translate_error(exc: grpc.RpcError) -> MetadataError:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return MetadataAuthError(f"metadata service refused the credentials (UNAUTHENTICATED): "
                                 f"{details}", code.name, details)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return MetadataAuthError(f"metadata service denied the call (PERMISSION_DENIED): "
                                 f"{details}", code.name, details)
    if code in _UNAVAILABLE:
        return MetadataUnavailable(f"metadata service unavailable ({code.name}): {details}",
                                   code.name, details)
    return MetadataRequestError(f"metadata service rejected the request ({code.name}): "
                                f"{details}", code.name, details)




def _query_request(
    chain: Sequence[BlockHash], role: str | int | None, node_ids: Sequence[NodeId],
    include_zero: bool,
) -> pb.QueryRequest:
    return pb.QueryRequest(block_hashes=pack_hashes(chain), role=role_value(role),
                           node_ids=list(node_ids), include_zero=include_zero)


def _snapshot_request(node_id: NodeId, epoch: int, seq: int, blocks: SnapshotBlocks
                      ) -> pb.SnapshotRequest:
    if isinstance(blocks, Mapping):
        hashes = list(blocks)
        masks = bytes(blocks[h] for h in hashes)
        media = b"" if masks.count(1) == len(masks) else masks
    else:
        hashes, media = list(blocks), b""
    return pb.SnapshotRequest(node_id=node_id, epoch=epoch, seq=seq,
                              block_hashes=pack_hashes(hashes), media=media)


def _client_request(client_id: str, curve_public_key: bytes, lease_ttl_s: int,
                    ticket_public_key: bytes = b"") -> pb.RegisterClientRequest:
    key = pb.ClientKey(client_id=client_id, curve_public_key=curve_public_key.decode(),
                       ticket_public_key=ticket_public_key)
    return pb.RegisterClientRequest(client=key, lease_ttl_s=lease_ttl_s)


def _publish_request(
    node_id: NodeId, epoch: int, seq: int, events: Iterable[KVEvent]
) -> pb.PublishRequest:
    return pb.PublishRequest(node_id=node_id, epoch=epoch, seq=seq, events=encode_events(events))


class _Base:
    def __init__(
        self,
        address: str,
        *,
        token: str | Callable[[], str] | None = None,
        cluster_secret: ClusterSecret | None = None,
        principal: str = SERVICE,
        tls_ca_file: str | None = None,
        tls_server_name: str | None = None,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        tls: ClientTLS | None = None,
        channel_options: Sequence[tuple[str, object]] = (),
        timeout_s: float = 5.0,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        if cluster_secret is not None:
            if token is not None:
                raise ValueError("give token or cluster_secret, not both")
            token = cluster_secret.metadata_token(principal)
        self._token = token
        if tls is None:
            tls = ClientTLS.from_fields(tls_ca_file, tls_cert_file, tls_key_file,
                                        tls_server_name)
        elif tls_ca_file is not None:
            raise ValueError("give tls or the tls_* files, not both")
        self._credentials = tls.channel_credentials() if tls is not None else None
        self._options = [*GRPC_OPTIONS, *channel_options,
                         *(tls.channel_options() if tls is not None else ())]

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...] | None:
        token = self._token() if callable(self._token) else self._token
        return ((AUTH_HEADER, f"Bearer {token}"),) if token else None


class MetadataClient(_Base):
    """Blocking client; thread-safe (one gRPC channel)."""

    def __init__(self, address: str, **kwargs: Any) -> None:  # _Base's keywords
        super().__init__(address, **kwargs)
        if self._credentials is None:
            self._channel = grpc.insecure_channel(address, options=self._options)
        else:
            self._channel = grpc.secure_channel(address, self._credentials, options=self._options)
        self._stub = pb_grpc.MetadataServiceStub(self._channel)

    def _call(self, method: str, request: object, timeout_s: float | None = None):
        try:
            return getattr(self._stub, method)(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_error(exc) from None

    def register(self, info: pb.NodeInfo, lease_ttl_s: int = 0, proof: bytes = b""
                 ) -> pb.RegisterReply:
        return self._call("Register", pb.RegisterRequest(node=info, lease_ttl_s=lease_ttl_s,
                                                         proof=proof))

    def register_client(self, client_id: str, curve_public_key: bytes,
                        lease_ttl_s: int = 0, ticket_public_key: bytes = b"") -> int:
        """A router's CURVE key and pull-ticket key (principal service only); returns the
        lease TTL granted."""
        return self._call("RegisterClient", _client_request(
            client_id, curve_public_key, lease_ttl_s, ticket_public_key)).lease_ttl_s

    def list_clients(self) -> list[pb.ClientKey]:
        return list(self._call("ListClients", pb.Empty()).clients)

    def exchange_node_token(self, service_account_token: str, node_id: NodeId,
                            role: str) -> pb.NodeTokenReply:
        """Node `node_id`'s token, for its pod's projected service-account token (needs no
        token of its own: the service checks the pod's with Kubernetes)."""
        return self._call("ExchangeNodeToken", pb.NodeTokenRequest(
            node_id=node_id, role=role_value(role),
            service_account_token=service_account_token))

    def release_node(self, node_id: NodeId) -> None:
        """An operator's action (principal operator): forget the id's registration."""
        self._call("ReleaseNode", pb.ReleaseNodeRequest(node_id=node_id))

    def heartbeat(self, node_id: NodeId, epoch: int, draining: bool = False) -> bool:
        return self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, epoch=epoch,
                                                           draining=draining)).known

    def deregister(self, node_id: NodeId, proof: bytes = b"") -> None:
        """Needs the registration's proof (its `registration_secret`) when it has a key."""
        self._call("Deregister", pb.DeregisterRequest(node_id=node_id, proof=proof))

    def list_nodes(self, role: str | int | None = None) -> list[pb.NodeInfo]:
        return list(self._call("ListNodes", pb.ListNodesRequest(role=role_value(role))).nodes)

    def watch_nodes(self, role: str | int | None = None) -> Iterator[pb.NodeChange]:
        """Every live node as UP, then changes, until the iterator is closed."""
        stream = self._stub.WatchNodes(pb.ListNodesRequest(role=role_value(role)),
                                       metadata=self._metadata)
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise translate_error(exc) from None
        finally:
            stream.cancel()

    def publish(
        self, node_id: NodeId, epoch: int, seq: int, events: Iterable[KVEvent]
    ) -> pb.PublishReply:
        return self._call("Publish", _publish_request(node_id, epoch, seq, events))

    def publish_raw(self, request: pb.PublishRequest) -> pb.PublishReply:
        return self._call("Publish", request)

    def snapshot(
        self, node_id: NodeId, epoch: int, seq: int, block_hashes: SnapshotBlocks
    ) -> int:
        request = _snapshot_request(node_id, epoch, seq, block_hashes)
        return self._call("Snapshot", request, max(self.timeout_s, 30.0)).last_seq

    def query(
        self,
        chain: Sequence[BlockHash],
        role: str | int | None = None,
        node_ids: Sequence[NodeId] = (),
        include_zero: bool = False,
    ) -> list[Match]:
        """(node, leading blocks of ``chain`` it holds), best first."""
        reply = self._call("Query", _query_request(chain, role, node_ids, include_zero))
        return [(m.node_id, m.num_blocks) for m in reply.matches]

    def stats(self) -> pb.StatsReply:
        return self._call("Stats", pb.Empty())

    def ping(self) -> None:
        self._call("Ping", pb.Empty())

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> MetadataClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncMetadataClient(_Base):
    """asyncio client; create and use it inside one running event loop."""

    def __init__(self, address: str, **kwargs: Any) -> None:  # _Base's keywords
        super().__init__(address, **kwargs)
        if self._credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=self._options)
        else:
            self._channel = grpc.aio.secure_channel(address, self._credentials,
                                                    options=self._options)
        self._stub = pb_grpc.MetadataServiceStub(self._channel)

    async def _call(self, method: str, request: object, timeout_s: float | None = None):
        try:
            return await getattr(self._stub, method)(
                request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise translate_error(exc) from None

    async def register(self, info: pb.NodeInfo, lease_ttl_s: int = 0, proof: bytes = b""
                       ) -> pb.RegisterReply:
        return await self._call("Register", pb.RegisterRequest(
            node=info, lease_ttl_s=lease_ttl_s, proof=proof))

    async def register_client(self, client_id: str, curve_public_key: bytes,
                              lease_ttl_s: int = 0, ticket_public_key: bytes = b"") -> int:
        reply = await self._call("RegisterClient", _client_request(
            client_id, curve_public_key, lease_ttl_s, ticket_public_key))
        return reply.lease_ttl_s

    async def list_clients(self) -> list[pb.ClientKey]:
        return list((await self._call("ListClients", pb.Empty())).clients)

    async def heartbeat(self, node_id: NodeId, epoch: int, draining: bool = False) -> bool:
        reply = await self._call("Heartbeat", pb.HeartbeatRequest(node_id=node_id, epoch=epoch,
                                                                  draining=draining))
        return reply.known

    async def deregister(self, node_id: NodeId, proof: bytes = b"") -> None:
        await self._call("Deregister", pb.DeregisterRequest(node_id=node_id, proof=proof))

    async def list_nodes(self, role: str | int | None = None) -> list[pb.NodeInfo]:
        reply = await self._call("ListNodes", pb.ListNodesRequest(role=role_value(role)))
        return list(reply.nodes)

    def watch_nodes(self, role: str | int | None = None
                    ) -> AsyncGenerator[pb.NodeChange, None]:
        request = pb.ListNodesRequest(role=role_value(role))
        return _streamed(lambda: self._stub.WatchNodes(request, metadata=self._metadata))

    def watch_blocks(self) -> AsyncGenerator[pb.BlockUpdate, None]:
        """The service's block index: a snapshot, SNAPSHOT_COMPLETE, then every change in
        the order it was applied. Runs until the stream ends or fails (a MetadataError)."""
        return _streamed(lambda: self._stub.WatchBlocks(pb.WatchBlocksRequest(),
                                                        metadata=self._metadata))

    async def publish(
        self, node_id: NodeId, epoch: int, seq: int, events: Iterable[KVEvent]
    ) -> pb.PublishReply:
        return await self._call("Publish", _publish_request(node_id, epoch, seq, events))

    async def snapshot(
        self, node_id: NodeId, epoch: int, seq: int, block_hashes: SnapshotBlocks
    ) -> int:
        request = _snapshot_request(node_id, epoch, seq, block_hashes)
        return (await self._call("Snapshot", request, max(self.timeout_s, 30.0))).last_seq

    async def query(
        self,
        chain: Sequence[BlockHash],
        role: str | int | None = None,
        node_ids: Sequence[NodeId] = (),
        include_zero: bool = False,
    ) -> list[Match]:
        reply = await self._call("Query", _query_request(chain, role, node_ids, include_zero))
        return [(m.node_id, m.num_blocks) for m in reply.matches]

    async def query_tiers(self, chain: Sequence[BlockHash]) -> list[TierMatch]:
        """(node, leading blocks of ``chain`` it holds, how many of them only on its host,
        only on disk), best first."""
        reply = await self._call("Query", _query_request(chain, None, (), False))
        return [(m.node_id, m.num_blocks, m.num_host_blocks, m.num_disk_blocks)
                for m in reply.matches]

    async def stats(self) -> pb.StatsReply:
        return await self._call("Stats", pb.Empty())

    async def ping(self) -> None:
        await self._call("Ping", pb.Empty())

    async def close(self) -> None:
        await self._channel.close()


async def _streamed(open_stream: Callable[[], Any]) -> AsyncGenerator[Any, None]:
    """The messages of the server stream `open_stream()` starts (on first iteration); a gRPC
    failure becomes a MetadataError, and the stream is cancelled however iteration ends."""
    stream = open_stream()
    try:
        async for message in stream:
            yield message
    except grpc.RpcError as exc:
        raise translate_error(exc) from None
    finally:
        stream.cancel()
