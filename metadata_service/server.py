"""The gRPC face of the metadata service: servicer, token check, TLS, and ways to run it.

Every RPC runs on the server's asyncio loop, which also owns the ``MetadataService`` (and so
the index): handlers call its synchronous methods directly. ``InvalidBatch`` becomes
INVALID_ARGUMENT with the precise message. With a token configured, a call without
``authorization: Bearer <token>`` metadata is refused with UNAUTHENTICATED before any work.

API: ``make_store``, ``MetadataServer`` (run in the current loop), ``ServerThread`` (run in a
background thread: embedding, tests, benchmarks), ``serve`` (the CLI's foreground server).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc

from metadata_service.config import MetadataConfig
from metadata_service.errors import InvalidBatch
from metadata_service.service import MetadataService
from metadata_service.store import IndexStore, MemoryIndexStore
from metadata_service.watch import SubscriberTooSlow
from metadata_service.wire import AUTH_HEADER, GRPC_OPTIONS
from proto import metadata_pb2 as pb
from proto import metadata_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Let clients keepalive-ping an idle stream (a WatchBlocks follower detecting a dead peer)
# down to once a second; gRPC's default (5 min) answers faster pings with GOAWAY.
_SERVER_OPTIONS = [*GRPC_OPTIONS, ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000)]


def make_store(config: MetadataConfig) -> IndexStore:
    if config.backend == "etcd":
        from metadata_service.etcd_store import EtcdIndexStore

        return EtcdIndexStore(config)
    return MemoryIndexStore()


class _Servicer(pb_grpc.MetadataServiceServicer):
    def __init__(self, service: MetadataService) -> None:
        self.service = service

    async def Register(self, request, context):  # noqa: N802 (gRPC method names)
        ttl, seq = await _checked(context, self.service.register, request.node,
                                  request.lease_ttl_s)
        return pb.RegisterReply(lease_ttl_s=ttl, last_seq=seq)

    async def Heartbeat(self, request, context):  # noqa: N802
        return pb.HeartbeatReply(known=self.service.heartbeat(request.node_id, request.epoch))

    async def Deregister(self, request, context):  # noqa: N802
        self.service.deregister(request.node_id)
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
        status, seq = await _checked(context, self.service.publish, request.node_id,
                                     request.epoch, request.seq, request.events)
        return pb.PublishReply(status=status, last_seq=seq)

    async def Snapshot(self, request, context):  # noqa: N802
        seq = await _checked(context, self.service.snapshot, request.node_id, request.epoch,
                             request.seq, request.block_hashes)
        return pb.SnapshotReply(last_seq=seq)

    async def Query(self, request, context):  # noqa: N802
        matches = await _checked(context, self.service.query, request.block_hashes,
                                 request.role, request.node_ids, request.include_zero)
        return pb.QueryReply(
            matches=[pb.NodeMatch(node_id=n, num_blocks=k) for n, k in matches],
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


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the shared token (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = str(metadata.get(AUTH_HEADER, "")).encode()
        if handler is None or hmac.compare_digest(given, self._expected):
            return handler
        return _denying_handler(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(_deny, **kwargs)


class MetadataServer:
    """A gRPC server around one ``MetadataService``, in the running event loop."""

    def __init__(self, config: MetadataConfig, store: IndexStore | None = None) -> None:
        self.config = config
        self.service = MetadataService(config, store or make_store(config))
        self.port = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        await self.service.start()
        interceptors = [_TokenInterceptor(self.config.token)] if self.config.token else []
        server = grpc.aio.server(interceptors=interceptors, options=_SERVER_OPTIONS)
        pb_grpc.add_MetadataServiceServicer_to_server(_Servicer(self.service), server)
        address = self.config.address
        if self.config.tls_cert_file:
            key = Path(self.config.tls_key_file).read_bytes()
            cert = Path(self.config.tls_cert_file).read_bytes()
            self.port = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        logger.info("metadata service (%s backend) listening on %s:%d",
                    self.service.store.name, self.config.host, self.port)
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
