"""`BlockingNodeClient`: a blocking client of `NodeServer` (a DEALER socket speaking core.node_wire)
for tools, benchmarks and tests. Torch-free. The router has its own asyncio link
(`router.routing.node_link.NodeLink`).
`curve`: the cluster's CURVE key pair (core.curve); a node refuses a client without it."""

from __future__ import annotations

import time

import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_client
from pdcluster.core.node_wire import NodeMessage, RequestError, TokenDelta, decode, encode


class BlockingNodeClient:
    def __init__(self, address: str, *, curve: CurveKeys | None) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            secure_client(self.socket, curve)
        self.socket.connect(address)

    def send(self, msg: NodeMessage) -> None:
        self.socket.send(encode(msg))

    def send_raw(self, frame: bytes) -> None:
        self.socket.send(frame)

    def recv(self, timeout_s: float = 30.0) -> NodeMessage:
        if not self.socket.poll(int(timeout_s * 1000)):
            raise TimeoutError("no reply from the node")
        return decode(self.socket.recv())

    def collect(self, request_ids: set[str], timeout_s: float = 60.0) -> dict[str, list]:
        """Every message per request id until each has finished or failed."""
        got: dict[str, list] = {rid: [] for rid in request_ids}
        open_ids = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while open_ids:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if not isinstance(msg, TokenDelta | RequestError):
                raise ValueError(f"expected replies to requests, got a {type(msg).__name__}")
            got[msg.request_id].append(msg)
            if isinstance(msg, RequestError) or (isinstance(msg, TokenDelta) and msg.finished):
                open_ids.discard(msg.request_id)
        return got

    def close(self) -> None:
        self.socket.close()


def tokens_of(messages: list) -> list[int]:
    return [t for m in messages if isinstance(m, TokenDelta) for t in m.token_ids]
