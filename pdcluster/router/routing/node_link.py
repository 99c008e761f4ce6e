"""Talking to node servers: one async ZMQ DEALER per node, speaking `core.node_wire`.

`NodeLink` owns one socket and one receive task; replies are dispatched by request id to
per-request queues (`TokenDelta`, `RequestError`) or to the pending load query
(`LoadReport`). `poll_load` keeps `report` fresh and decides `healthy`: a node is healthy
while it answers load queries within the timeout and is not draining. Between reports the
router adds the prompt tokens it dispatched itself (`pending_tokens`), so a burst does not
all land on the node that looked idle at the last report. A node that misses
`DEAD_AFTER_MISSED_POLLS` load polls in a row is taken for dead: its open streams end with a
`RequestError` instead of waiting forever (one miss is not enough — a node answers between
engine steps, and a long prefill step can delay one reply).

Fast death detection: a ZMQ socket monitor watches the DEALER's connection. When the node's
process dies its TCP connection closes (`EVENT_DISCONNECTED`): the node is unhealthy at once,
its open streams end with `RequestError("internal", "node X disconnected")`, and requests
sent to it fail immediately, until it reconnects and answers a load poll again. The
missed-poll rule stays as the backstop for a node that hangs while its connection stays up.
Streams ended this way are marked `lost` (the node is gone, it did not refuse the request), so
the router may move the request elsewhere (router.routing.migration).

Authentication: the socket is a CURVE client presenting the router's own key pair and
expecting the node's registered public key (`NodeSpec.curve_public_key`; core.curve); the
node admits the router once the metadata service vouches for its key. A failed handshake is
logged once, ZMQ retries it on every reconnect, and the node stays unhealthy meanwhile.

API: `NodeLink`, `NodeStream`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_client
from pdcluster.core.node_wire import (
    MAX_FRAME_BYTES,
    AbortRequest,
    GenerateRequest,
    LoadQuery,
    LoadReport,
    NodeMessage,
    PrefillLost,
    RequestError,
    TokenDelta,
    decode,
    encode,
)
from pdcluster.core.wire import WireError
from pdcluster.router.config import NodeSpec

logger = logging.getLogger(__name__)


DEAD_AFTER_MISSED_POLLS = 3
HANDSHAKE_RETRY_S = 1.0
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED


class NodeStream:
    """The replies of one request on one node, in order."""

    def __init__(self, client: NodeLink, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue[TokenDelta | RequestError] = asyncio.Queue()
        self.finished = False
        self.lost = False  # ended because the node is gone (not a refusal by the node)

    async def __aiter__(self) -> AsyncIterator[TokenDelta | RequestError]:
        while not self.finished:
            msg = await self.queue.get()
            if isinstance(msg, RequestError) or msg.finished:
                self.finished = True
                self.client.forget(self.request_id)
            yield msg


class NodeLink:
    def __init__(self, spec: NodeSpec, context: zmq.asyncio.Context, *,
                 curve: CurveKeys | None) -> None:
        self.spec = spec
        self.report: LoadReport | None = None
        self.healthy = False
        self.pending_tokens = 0
        self.missed_polls = 0
        self.last_report_at = 0.0
        self.disconnected = False  # the connection closed and has not come back yet
        self.refused_us = False  # a CURVE handshake with the node failed
        # bumped whenever what the policy sees of this node changes (report, health, pending
        # tokens, requests in flight): the dispatcher refreshes its view of the node only then
        self.version = 0
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # a node's frame past this is dropped by ZMQ before the router reads a byte of it
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if curve is not None:
            secure_client(self._socket, curve, spec.curve_public_key or None)
        self._monitor = self._socket.get_monitor_socket(_MONITORED)
        self._socket.connect(spec.request_address)
        self._streams: dict[str, NodeStream] = {}
        self._load_waiter: asyncio.Future[LoadReport] | None = None
        self._gone: asyncio.Future[None] | None = None  # resolved when the connection closes
        self._receiver = asyncio.create_task(self._receive_forever(), name=f"recv-{spec.node_id}")
        self._watcher = asyncio.create_task(self._watch_forever(), name=f"mon-{spec.node_id}")

    @property
    def node_id(self) -> str:
        return self.spec.node_id

    @property
    def num_inflight(self) -> int:
        return len(self._streams)

    async def generate(self, request: GenerateRequest) -> NodeStream:
        stream = NodeStream(self, request.request_id)
        self._streams[request.request_id] = stream
        self.pending_tokens += len(request.prompt_token_ids)
        self.version += 1
        if self.disconnected:  # it would wait in the socket's queue for a node that is gone
            self._fail(stream, f"node {self.node_id} disconnected")
            return stream
        try:
            await self._send(request)
        except zmq.ZMQError as exc:
            self._fail(stream, f"node {self.node_id} is unreachable: {exc}")
        return stream

    async def abort(self, request_id: str) -> None:
        self.forget(request_id)
        try:
            await self._send(AbortRequest(request_id))
        except zmq.ZMQError as exc:  # the node is unreachable: nothing to abort there now
            logger.debug("abort of %s on node %s not sent: %s", request_id, self.node_id, exc)

    async def prefill_lost(self, request_id: str, transfer_id: str, reason: str) -> None:
        """Tell this (decode) node that the prefill node of `request_id` is gone."""
        try:
            await self._send(PrefillLost(request_id, transfer_id, reason))
        except zmq.ZMQError as exc:  # this node is unreachable too: its stream fails anyway
            logger.debug("prefill-lost notice for %s not sent to %s: %s", request_id,
                         self.node_id, exc)

    def gone(self) -> asyncio.Future[None]:
        """Done when this node's connection next closes (at once if it is closed now): for
        watching a node after its own request ended, e.g. a prefill node whose KV is still on
        its way to a decode node."""
        if self._gone is None or (self._gone.done() and not self.disconnected):
            self._gone = asyncio.get_running_loop().create_future()
            if self.disconnected:
                self._gone.set_result(None)
        return self._gone

    def forget(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.version += 1

    def fail_streams(self, message: str) -> None:
        """End every open request on this node with an error (the node is gone)."""
        for stream in list(self._streams.values()):
            self._fail(stream, message)

    def _fail(self, stream: NodeStream, message: str) -> None:
        stream.lost = True
        stream.queue.put_nowait(RequestError(stream.request_id, "internal", message))
        self.forget(stream.request_id)

    async def poll_load(self, timeout_s: float) -> LoadReport | None:
        loop = asyncio.get_running_loop()
        self._load_waiter = loop.create_future()
        try:
            await self._send(LoadQuery())
            report = await asyncio.wait_for(self._load_waiter, timeout_s)
        except (TimeoutError, zmq.ZMQError):
            self.healthy = False
            self.version += 1
            self.missed_polls += 1
            if self.missed_polls >= DEAD_AFTER_MISSED_POLLS:
                self.fail_streams(f"node {self.node_id} stopped answering")
            return None
        self.report, self.pending_tokens, self.missed_polls = report, 0, 0
        self.last_report_at = time.monotonic()
        self.healthy = not report.draining and not self.disconnected
        self.version += 1
        return report

    async def _send(self, msg: NodeMessage) -> None:
        # Never wait: with the node gone the socket queues up to its high-water mark and then
        # would block forever; `zmq.Again` instead.
        await self._socket.send(encode(msg), zmq.NOBLOCK)

    async def _receive_forever(self) -> None:
        while True:
            try:
                frame = await self._socket.recv()
                msg = decode(frame)
            except WireError as exc:
                logger.warning("node %s sent a malformed reply: %s", self.node_id, exc)
                continue
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self._dispatch(msg)

    async def _watch_forever(self) -> None:
        while True:
            try:
                event = await recv_monitor_message(self._monitor)
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            self._on_event(event["event"])

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_DISCONNECTED:
            logger.warning("node %s disconnected", self.node_id)
            self.disconnected, self.healthy = True, False
            self.version += 1
            self.fail_streams(f"node {self.node_id} disconnected")
            if self._gone is not None and not self._gone.done():
                self._gone.set_result(None)
        elif event & _HANDSHAKE_FAILED:
            if not self.refused_us:  # logged once
                logger.error("node %s refused the router's key (not registered with its "
                             "metadata service yet, or another cluster's node?); retrying",
                             self.node_id)
            self.refused_us = True
            # libzmq does not retry a handshake the peer's ZAP handler refused: reconnect
            # ourselves, once the key may have been registered
            loop = asyncio.get_running_loop()
            loop.call_later(HANDSHAKE_RETRY_S, self._reconnect)
        elif event == zmq.EVENT_CONNECTED and self.refused_us:
            self.refused_us = False
            logger.info("node %s admitted the router", self.node_id)
        elif event == zmq.EVENT_CONNECTED and self.disconnected:
            logger.info("node %s reconnected", self.node_id)
            self.disconnected = False  # healthy again once it answers a load poll

    def _reconnect(self) -> None:
        if self._socket.closed or not self.refused_us:
            return
        address = self.spec.request_address
        with contextlib.suppress(zmq.ZMQError):  # already gone: connect again all the same
            self._socket.disconnect(address)
        self._socket.connect(address)

    def _dispatch(self, msg: NodeMessage) -> None:
        if isinstance(msg, LoadReport):
            if self._load_waiter is not None and not self._load_waiter.done():
                self._load_waiter.set_result(msg)
        elif isinstance(msg, TokenDelta | RequestError):
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream.queue.put_nowait(msg)
        else:
            logger.warning("node %s sent a %s to the router", self.node_id, type(msg).__name__)

    async def close(self) -> None:
        self.fail_streams(f"node {self.node_id} left the router's view")
        self._receiver.cancel()
        self._watcher.cancel()
        try:
            await asyncio.gather(self._receiver, self._watcher, return_exceptions=True)
        finally:  # even when the close itself is cancelled: an open socket blocks the
            # context's termination (`Dispatcher.close`)
            self._socket.disable_monitor()
            self._monitor.close(0)
            self._socket.close(0)
