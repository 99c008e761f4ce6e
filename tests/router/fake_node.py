"""A fake node server for router tests: a real ZMQ ROUTER socket speaking core.node_wire,
answering deterministic tokens. Swap it for a real node (node.server.NodeServer) by
pointing the router at that node's address instead: the router sees only the protocol.

`FakeNode(script)` answers every GenerateRequest with `script` token ids (cycled up to
max_tokens), the first after `ttft_s`, then one TokenDelta per token every `delay_s`;
`refuse` answers RequestError instead. With `model` (a function of the whole sequence,
prompt + tokens so far, to the next token) it behaves like greedy decoding instead: a
request continued on another node (router migration) goes on exactly. `frozen = True`
makes it hang (connected, silent); `close()` makes it die (its connection closes); `port`
binds a given port (a node coming back).
Everything received is recorded in `received` for assertions.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import zmq

from pdcluster.core.curve import secure_server, stop_authenticator
from pdcluster.core.node_wire import (
    AbortRequest,
    GenerateRequest,
    LoadQuery,
    LoadReport,
    RequestError,
    TokenDelta,
    decode,
    encode,
)
from tests.cluster_secret import TEST_CURVE


class FakeNode:
    def __init__(self, node_id: str, script: list[int], role: str = "both",
                 delay_s: float = 0.0, refuse: str | None = None,
                 model: Callable[[list[int]], int] | None = None, port: int | None = None,
                 ttft_s: float = 0.0) -> None:
        self.node_id, self.role, self.script = node_id, role, script
        self.delay_s, self.refuse, self.model, self.ttft_s = delay_s, refuse, model, ttft_s
        self.received: list[object] = []
        self.answer_load = True
        self.frozen = False
        self._active: dict[str, list] = {}  # request id -> [identity, request, sent, due, tokens]
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        secure_server(self._socket, TEST_CURVE)  # as real nodes: the router must hold the keys
        if port is None:
            port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        else:
            self._socket.bind(f"tcp://127.0.0.1:{port}")
        self.port = port
        self.address = f"tcp://127.0.0.1:{port}"
        self.kv_address = f"tcp://127.0.0.1:{port + 1}"  # never dialled by the router
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def requests(self) -> list[GenerateRequest]:
        return [m for m in self.received if isinstance(m, GenerateRequest)]

    def num_active(self) -> int:
        return len(self._active)

    def aborts(self) -> list[str]:
        return [m.request_id for m in self.received if isinstance(m, AbortRequest)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)
        stop_authenticator(self._context)
        self._context.term()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if self.frozen:
                time.sleep(0.002)
                continue
            if poller.poll(timeout=2):
                identity, frame = self._socket.recv_multipart()
                self._handle(identity, decode(frame))
            self._step()

    def _handle(self, identity: bytes, msg: object) -> None:
        if not isinstance(msg, LoadQuery):
            self.received.append(msg)
        if isinstance(msg, LoadQuery) and self.answer_load:
            self._send(identity, LoadReport(self.node_id, self.role, 0, len(self._active),
                                            1000, 1000, 0))
        elif isinstance(msg, AbortRequest):
            self._active.pop(msg.request_id, None)
        elif isinstance(msg, GenerateRequest):
            if self.refuse:
                self._send(identity, RequestError(msg.request_id, self.refuse, "refused"))
            else:
                self._active[msg.request_id] = [identity, msg, 0, time.monotonic() + self.ttft_s,
                                                  []]

    def _step(self) -> None:
        now = time.monotonic()
        for request_id, state in list(self._active.items()):
            identity, msg, sent, due, generated = state
            if now < due:
                continue
            token = self._next_token(msg, generated, sent)
            generated.append(token)
            sent += 1
            done = sent >= msg.sampling.max_tokens
            self._send(identity, TokenDelta(request_id, [token], done,
                                            "length" if done else None, None,
                                            len(msg.prompt_token_ids), 0))
            if done:
                del self._active[request_id]
            else:
                state[2], state[3] = sent, now + self.delay_s

    def _next_token(self, msg: GenerateRequest, generated: list[int], sent: int) -> int:
        if self.model is not None:
            return self.model(msg.prompt_token_ids + generated)
        return self.script[sent % len(self.script)]

    def _send(self, identity: bytes, msg: object) -> None:
        self._socket.send_multipart([identity, encode(msg)])
