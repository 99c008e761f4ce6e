"""The gRPC face of the metadata service: servicer, authentication, TLS, and ways to run it.

Every RPC runs on the server's asyncio loop, which also owns the ``MetadataService`` (and so
the index): handlers call its synchronous methods directly. ``InvalidBatch`` becomes
INVALID_ARGUMENT with the precise message.

Authentication (always on unless the config says ``allow_unauthenticated``, for unit tests):
every call must carry ``authorization: Bearer <token>`` with a token derived from the cluster
secret for a principal (``core.credentials``); one without a valid token is refused with
UNAUTHENTICATED before any work, streams included. Authorization: any principal may read
(ListNodes, WatchNodes, WatchBlocks, Query, Stats, Ping, ListClients); Register, Heartbeat,
Publish, Snapshot and Deregister for node X are allowed only to principal ``node/X``
(PERMISSION_DENIED otherwise), checked in the servicer, which alone sees the request's node id;
a Register that would change X's live registration, or a Deregister, without its proof is
PERMISSION_DENIED too, as is one that would share a live node's key, address or session, or
an id off the allowlist (metadata_service.identities). RegisterClient (a router's key) is
``service``'s alone, ReleaseNode ``operator``'s. ExchangeNodeToken needs no token: a pod's
projected service-account token, checked with Kubernetes' TokenReview, buys it a node token
(``pod_identity``; token_exchange.py, node_tokens.py).

TLS (config ``tls_cert_file``/``tls_key_file``) and mTLS (``tls_client_ca_file``: a client
without a certificate signed by that CA fails the handshake) protect the connection; the token
is checked on top, whatever the transport. With ``tls_bind_client_roles`` the certificate's
role must also match the token's principal (cert_roles.py).

API: ``make_store``, ``MetadataServer`` (run in the current loop), ``ServerThread`` (run in a
background thread: embedding, tests, benchmarks), ``serve`` (the CLI's foreground server).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc

from pdcluster.core.credentials import (
    OPERATOR,
    SERVICE,
    node_principal,
)
from pdcluster.metadata_service.auth import AuthInterceptor, Verifier
from pdcluster.metadata_service.config import MetadataConfig
from pdcluster.metadata_service.errors import InvalidBatch
from pdcluster.metadata_service.identities import RegistrationConflict
from pdcluster.metadata_service.node_tokens import NodeTokenIssuer
from pdcluster.metadata_service.service import MetadataService
from pdcluster.metadata_service.store import IndexStore, MemoryIndexStore
from pdcluster.metadata_service.token_exchange import TokenExchange
from pdcluster.metadata_service.watch import SubscriberTooSlow
from pdcluster.metadata_service.wire import GRPC_OPTIONS
from pdcluster.proto import metadata_pb2 as pb
from pdcluster.proto import metadata_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Let clients keepalive-ping an idle stream (a WatchBlocks follower detecting a dead peer)
# down to once a second; gRPC's default (5 min) answers faster pings with GOAWAY.
_SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000)]


def make_store(config: MetadataConfig) -> IndexStore:
    if config.backend == "etcd":
        from pdcluster.metadata_service.etcd_store import EtcdIndexStore

        return EtcdIndexStore(config)
    return MemoryIndexStore()


class _Servicer(pb_grpc.MetadataServiceServicer):
    def __init__(self, service: MetadataService, verifier: Verifier | None,
                 exchange: TokenExchange) -> None:
        self.service = service
        self._verifier = verifier  # None: unauthenticated (unit tests of this room only)
        self._exchange = exchange

    async def _acting_as(self, context: grpc.aio.ServicerContext, node_id: str) -> None:
        """Abort unless the caller's principal is ``node/<node_id>``. The interceptor has
        already refused calls without a valid token; this re-reads the token (one HMAC)
        because only the servicer sees which node a request acts for."""
        if self._verifier is None:
            return
        principal = self._verifier.principal(context.invocation_metadata())
        if principal is None:  # only if a call got past the interceptor somehow
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
        if principal != node_principal(node_id):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"principal {principal!r} may not act as node {node_id!r}: only its own "
                f"credential ({node_principal(node_id)!r}) may register, heartbeat, publish, "
                "snapshot or deregister it")

    async def _require(self, context: grpc.aio.ServicerContext, principal: str,
                       what: str) -> None:
        """Abort unless the caller's principal is `principal`."""
        if self._verifier is None:
            return
        caller = self._verifier.principal(context.invocation_metadata())
        if caller != principal:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"principal {caller!r} may not {what}: only {principal!r} may")

    async def Register(self, request, context):  # noqa: N802 (gRPC method names)
        await self._acting_as(context, request.node.node_id)
        ttl, seq, secret = await _checked(context, self.service.register_node,
                                          request.node, request.lease_ttl_s, request.proof)
        return pb.RegisterReply(lease_ttl_s=ttl, last_seq=seq, registration_secret=secret)

    async def RegisterClient(self, request, context):  # noqa: N802
        await self._require(context, SERVICE, "register a router's key")
        ttl = await _checked(context, self.service.register_client, request.client,
                             request.lease_ttl_s)
        return pb.RegisterClientReply(lease_ttl_s=ttl)

    async def ListClients(self, request, context):  # noqa: N802
        return pb.ListClientsReply(clients=self.service.clients.list())

    async def ReleaseNode(self, request, context):  # noqa: N802
        await self._require(context, OPERATOR, "release a node's registration")
        self.service.release_node(request.node_id)
        return pb.Empty()

    async def ExchangeNodeToken(self, request, context):  # noqa: N802
        return await self._exchange.handle(request, context)

    async def Heartbeat(self, request, context):  # noqa: N802
        await self._acting_as(context, request.node_id)
        return pb.HeartbeatReply(known=self.service.heartbeat(request.node_id, request.epoch,
                                                              request.draining))

    async def Deregister(self, request, context):  # noqa: N802
        await self._acting_as(context, request.node_id)
        await _checked(context, self.service.deregister, request.node_id, request.proof)
        return pb.Empty()

    async def ListNodes(self, request, context):  # noqa: N802
        return pb.ListNodesReply(nodes=self.service.list_nodes(request.role))

    async def WatchNodes(self, request, context):  # noqa: N802
        watch = self.service.node_watch
        queue = watch.subscribe(self.service.list_nodes())
        try:
            while True:
                change = await queue.get()
                if request.role in (pb.ROLE_UNSPECIFIED, change.node.role):
                    yield change
        finally:
            watch.unsubscribe(queue)

    async def WatchBlocks(self, request, context):  # noqa: N802
        index = self.service.index
        subscriber = index.subscribe()
        try:
            async for update in subscriber.updates():
                yield update
        except SubscriberTooSlow as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        finally:
            index.unsubscribe(subscriber)

    async def Publish(self, request, context):  # noqa: N802
        await self._acting_as(context, request.node_id)
        status, seq = await _checked(context, self.service.publish, request.node_id,
                                     request.epoch, request.seq, request.events)
        return pb.PublishReply(status=status, last_seq=seq)

    async def Snapshot(self, request, context):  # noqa: N802
        await self._acting_as(context, request.node_id)
        seq = await _checked(context, self.service.snapshot, request.node_id, request.epoch,
                             request.seq, request.block_hashes, request.media)
        return pb.SnapshotReply(last_seq=seq)

    async def Query(self, request, context):  # noqa: N802
        matches = await _checked(context, self.service.query_tiers, request.block_hashes,
                                 request.role, request.node_ids, request.include_zero)
        return pb.QueryReply(
            matches=[pb.NodeMatch(node_id=n, num_blocks=k, num_host_blocks=host,
                                  num_disk_blocks=disk) for n, k, host, disk in matches],
            num_query_blocks=len(request.block_hashes) // self.service.config.hash_size,
        )

    async def Stats(self, request, context):  # noqa: N802
        return self.service.stats()

    async def Ping(self, request, context):  # noqa: N802
        return pb.Empty()


async def _checked(context: grpc.aio.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except InvalidBatch as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{exc.reason}: {exc}")
        raise AssertionError("abort returned") from exc
    except RegistrationConflict as exc:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        raise AssertionError("abort returned") from exc


def _server_credentials(config: MetadataConfig) -> grpc.ServerCredentials:
    """TLS with the service's certificate; with a client CA, mTLS: the handshake fails for a
    client that presents no certificate or one the CA did not sign."""
    assert config.tls_key_file is not None and config.tls_cert_file is not None, \
        "TLS is on only with both files (MetadataConfig checks)"
    key = Path(config.tls_key_file).read_bytes()
    cert = Path(config.tls_cert_file).read_bytes()
    client_ca = (Path(config.tls_client_ca_file).read_bytes()
                 if config.tls_client_ca_file is not None else None)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _transport_name(config: MetadataConfig) -> str:
    if config.tls_client_ca_file:
        return "mTLS, roles bound" if config.tls_bind_client_roles else "mTLS"
    return "TLS" if config.tls_cert_file else "plaintext"


class MetadataServer:
    """A gRPC server around one ``MetadataService``, in the running event loop."""

    def __init__(self, config: MetadataConfig, store: IndexStore | None = None) -> None:
        self.config = config
        self.service = MetadataService(config, store or make_store(config))
        self.port = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        await self.service.start()
        secret = self.config.cluster_secret
        identity = self.config.pod_identity
        verifier = None if secret is None else Verifier(secret, self.config.router_token,
                                                        pod_tokens=identity is not None)
        issuer = (None if identity is None or secret is None else
                  NodeTokenIssuer(identity, secret, self.config.node_token_refusal))
        exchange = TokenExchange(issuer, self.config.tls_bind_client_roles)
        interceptors = ([AuthInterceptor(verifier, self.config.tls_bind_client_roles)]
                        if verifier is not None else [])
        server = grpc.aio.server(interceptors=interceptors, options=_SERVER_OPTIONS)
        pb_grpc.add_MetadataServiceServicer_to_server(_Servicer(self.service, verifier, exchange),
                                                  server)
        address = self.config.address
        if self.config.tls_cert_file:
            self.port = server.add_secure_port(address, _server_credentials(self.config))
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        if secret is None:
            logger.warning("metadata service WITHOUT authentication (allow_unauthenticated: "
                           "for tests only)")
        logger.info("metadata service (%s backend) listening on %s:%d (%s)",
                    self.service.store.name, self.config.host, self.port,
                    _transport_name(self.config))
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.service.close()

    async def wait_for_termination(self) -> None:
        assert self._server is not None, "server not started"
        await self._server.wait_for_termination()


class ServerThread:
    """Runs a ``MetadataServer`` on its own event loop in a daemon thread."""

    def __init__(self, config: MetadataConfig, store: IndexStore | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="metadata-server",
                                        daemon=True)
        self._config = config
        self._store = store
        self.server: MetadataServer | None = None

    def start(self) -> ServerThread:
        self._thread.start()

        async def build() -> MetadataServer:
            server = MetadataServer(self._config, self._store)
            await server.start()
            return server

        self.server = asyncio.run_coroutine_threadsafe(build(), self._loop).result(timeout=60)
        return self

    @property
    def address(self) -> str:
        assert self.server is not None, "server not started"
        return f"{self._config.host}:{self.server.port}"

    def call(self, fn: Callable[[MetadataService], T], timeout_s: float = 30.0) -> T:
        """Run ``fn(service)`` on the server's loop (the index's owner) and return its result."""
        assert self.server is not None, "server not started"
        service = self.server.service
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn(service))
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future.result(timeout=timeout_s)

    def stop(self, grace_s: float = 0.5) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result(30)
            self.server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


async def serve(config: MetadataConfig, ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM; ``ready(port)`` is called once listening."""
    server = MetadataServer(config)
    await server.start()
    if ready is not None:
        ready(server.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()
