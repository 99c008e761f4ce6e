"""Talking to node servers: one async ZMQ DEALER per node, speaking `core.node_wire`.

`NodeClient` owns one socket and one receive task; replies are dispatched by request id to
per-request queues (`TokenDelta`, `RequestError`) or to the pending load query
(`LoadReport`). `poll_load` keeps `report` fresh and decides `healthy`: a node is healthy
while it answers load queries within the timeout and is not draining. Between reports the
router adds the prompt tokens it dispatched itself (`pending_tokens`), so a burst does not
all land on the node that looked idle at the last report. A node that misses
`DEAD_AFTER_MISSED_POLLS` load polls in a row is taken for dead: its open streams end with a
`RequestError` instead of waiting forever (one miss is not enough — a node answers between
engine steps, and a long prefill step can delay one reply).

API: `NodeClient`, `NodeStream`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from core.node_wire import (
    AbortRequest,
    GenerateRequest,
    LoadQuery,
    LoadReport,
    NodeMessage,
    RequestError,
    TokenDelta,
    decode,
    encode,
)
from core.wire import WireError
from router.config import NodeSpec

logger = logging.getLogger(__name__)


DEAD_AFTER_MISSED_POLLS = 3


class NodeStream:
    """The replies of one request on one node, in order."""

    def __init__(self, client: NodeClient, request_id: str) -> None:
        self.client = client
        self.request_id = request_id
        self.queue: asyncio.Queue[TokenDelta | RequestError] = asyncio.Queue()
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[TokenDelta | RequestError]:
        while not self.finished:
            msg = await self.queue.get()
            if isinstance(msg, RequestError) or msg.finished:
                self.finished = True
                self.client.forget(self.request_id)
            yield msg


class NodeClient:
    def __init__(self, spec: NodeSpec, context: zmq.asyncio.Context) -> None:
        self.spec = spec
        self.report: LoadReport | None = None
        self.healthy = False
        self.pending_tokens = 0
        self.missed_polls = 0
        self.last_report_at = 0.0
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(spec.request_address)
        self._streams: dict[str, NodeStream] = {}
        self._load_waiter: asyncio.Future[LoadReport] | None = None
        self._receiver = asyncio.create_task(self._receive_forever(), name=f"recv-{spec.node_id}")

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
        await self._send(request)
        return stream

    async def abort(self, request_id: str) -> None:
        self.forget(request_id)
        await self._send(AbortRequest(request_id))

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def fail_streams(self, message: str) -> None:
        """End every open request on this node with an error (the node is gone)."""
        for request_id, stream in list(self._streams.items()):
            stream.queue.put_nowait(RequestError(request_id, "internal", message))
            self.forget(request_id)

    async def poll_load(self, timeout_s: float) -> LoadReport | None:
        loop = asyncio.get_running_loop()
        self._load_waiter = loop.create_future()
        try:
            await self._send(LoadQuery())
            report = await asyncio.wait_for(self._load_waiter, timeout_s)
        except (TimeoutError, zmq.ZMQError):
            self.healthy = False
            self.missed_polls += 1
            if self.missed_polls >= DEAD_AFTER_MISSED_POLLS:
                self.fail_streams(f"node {self.node_id} stopped answering")
            return None
        self.report, self.pending_tokens, self.missed_polls = report, 0, 0
        self.last_report_at = time.monotonic()
        self.healthy = not report.draining
        return report

    async def _send(self, msg: NodeMessage) -> None:
        await self._socket.send(encode(msg))

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
        self._receiver.cancel()
        await asyncio.gather(self._receiver, return_exceptions=True)
        self._socket.close(0)
