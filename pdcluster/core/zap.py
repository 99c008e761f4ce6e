"""The ZAP handler (ZeroMQ RFC 27) of one ZMQ context: the CURVE handshakes of every socket
the context serves are decided here.

A key the admission knows now is answered at once; a key it does not know waits for the
directory's next refresh (a key registered just before its handshake must still get in, and
a refused handshake is never retried) — on a lookup thread of its own, so strangers' keys
never hold up members' handshakes. libzmq opens one ZAP request socket per connection, so a
ROUTER here may answer requests out of order. Replies carry the client's Z85 key as the
connection's User-Id (`core.curve.sender_principal` reads it back per message); mechanism
NULL (a socket without CURVE) is answered 200 as pyzmq's handler does.

API: `ZapServer(context, decide)`: `start`, `stop`; `decide(domain, z85_key, wait)` is True
(admit), False (refuse) or, without `wait`, None (only the directory's next refresh can tell).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_VERSION = b"1.0"
_STOP = object()

Decide = Callable[[str, bytes, bool], "bool | None"]


class ZapServer:
    def __init__(self, context: zmq.Context[Any], decide: Decide) -> None:
        self._context, self._decide = context, decide
        self._lookups: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[list[bytes]] = queue.SimpleQueue()
        wake = f"inproc://pdcluster-zap-wake-{id(self):x}"
        self._wake_in = context.socket(zmq.PAIR)  # the serve thread's end
        self._wake_in.bind(wake)
        self._wake_out = context.socket(zmq.PAIR)  # the lookup thread's end
        self._wake_out.connect(wake)
        self._router = context.socket(zmq.ROUTER)
        self._router.linger = 0
        self._router.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._serve, daemon=True, name="zap"),
                         threading.Thread(target=self._lookup, daemon=True, name="zap-lookup")]

    def start(self) -> ZapServer:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._lookups.put(_STOP)
        for thread in self._threads:
            thread.join(5)
        for sock in (self._router, self._wake_in, self._wake_out):
            sock.close(linger=0)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._router in events:
                self._request(self._router.recv_multipart())
            if self._wake_in in events:
                self._wake_in.recv()
            while True:  # answers the lookup thread has ready
                try:
                    self._router.send_multipart(self._answers.get_nowait())
                except queue.Empty:
                    break

    def _request(self, frames: list[bytes]) -> None:
        """One ZAP request: [routing id, b"", version, request id, domain, address, identity,
        mechanism, credentials...]."""
        if len(frames) < 8 or frames[1] != b"":
            logger.warning("malformed ZAP request (%d frames)", len(frames))
            return
        envelope, (version, request_id, domain, _, _, mechanism, *credentials) = \
            frames[:2], frames[2:]
        if version != _VERSION:
            self._router.send_multipart(_reply(envelope, request_id, False, b"Invalid version"))
        elif mechanism == b"NULL":
            self._router.send_multipart(_reply(envelope, request_id, True, b"", b"anonymous"))
        elif mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self._router.send_multipart(_reply(envelope, request_id, False,
                                               b"Unsupported mechanism"))
        else:
            key = z85.encode(credentials[0])
            domain_name = domain.decode("utf-8", "replace")
            verdict = self._decide(domain_name, key, False)
            if verdict is None:  # unknown now: ask the directory, off this thread
                self._lookups.put((envelope, request_id, domain_name, key))
            else:
                self._router.send_multipart(_reply(envelope, request_id, verdict, b"",
                                                   key if verdict else b""))

    def _lookup(self) -> None:
        while True:
            item = self._lookups.get()
            if item is _STOP:
                return
            envelope, request_id, domain, key = item
            try:
                ok = bool(self._decide(domain, key, True))
            except Exception:  # a broken directory refuses; it must not end the handler
                logger.exception("ZAP lookup failed")
                ok = False
            self._answers.put(_reply(envelope, request_id, ok, b"", key if ok else b""))
            self._wake_out.send(b"")


def _reply(envelope: list[bytes], request_id: bytes, ok: bool, text: bytes,
           user_id: bytes = b"") -> list[bytes]:
    status = (b"200", text or b"OK") if ok else (b"400", text or b"Unknown key")
    return [*envelope, _VERSION, request_id, *status, user_id if ok else b"", b""]
