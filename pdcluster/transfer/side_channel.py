"""The side channel: ZMQ + msgpack control messages between nodes (XferRequest, XferAbort,
XferDone from `core.kv_transfer`). Each message is one frame of `encode(msg)`; nothing else
(de)serialises here, and nothing is pickled.

API:
- `SideChannelServer(handler, host="127.0.0.1", port=0, *, curve=keys)`: a ROUTER socket
  (`.address` is "tcp://host:port"; port 0 picks a free one) drained by a daemon thread that
  decodes each frame and calls `handler(msg)`. Bad frames are rejected and counted
  (`.num_rejected`), handler exceptions are counted (`.num_handler_errors`); neither stops
  the loop. `close()` returns within about `poll_interval_s`. Context manager.
- `SideChannelClient` (transfer/side_channel_client.py, re-exported here): `send(address, msg,
  on_failure)`, fire and forget, never blocking its caller; bounded sockets and queue.

Authentication: with `curve` (the node's own key pair) and `directory` (core.identity: who
each key is), both ends speak ZMQ CURVE (core.curve): a peer whose key names no registered
node cannot complete the handshake, so it can send nothing and read nothing. Authorisation:
`authorize(msg, principal)` (the connector worker's) sees each decoded message with its
sender's principal before the handler does, and refuses what that principal may not send
(counted in `num_forbidden`). Without a directory, `curve` is the shared pair of the test
mode; `curve=None` is plaintext, for unit tests of this room only.

Both sides share the process's `zmq.Context.instance()` and close only their own sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from pdcluster.core.connections import PeerConnections
from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_server
from pdcluster.core.identity import MEMBER, Directory
from pdcluster.core.kv_transfer import MAX_MESSAGE_BYTES, SideChannelMessage, decode
from pdcluster.core.throttle import Throttle as _Throttle
from pdcluster.core.wire import WireError
from pdcluster.transfer.side_channel_client import SideChannelClient

__all__ = ["MAX_FRAME_BYTES", "Authorizer", "MessageHandler", "SideChannelClient",
           "SideChannelServer"]

logger = logging.getLogger(__name__)

MessageHandler = Callable[[SideChannelMessage], None]
# (message, the sender's principal) -> None to accept it, or why it is refused
Authorizer = Callable[[SideChannelMessage, str | None], str | None]
# Frames beyond this are dropped by ZMQ itself (it disconnects the sender) before any memory
# or decryption is spent; frames between MAX_MESSAGE_BYTES and this are received and counted
# as rejected.
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + (64 << 10)
_REASON_CHARS = 200
MAX_STRIKES_PER_S = 50


class SideChannelServer:
    """Receives side-channel messages on a ROUTER socket and hands them to `handler` on a
    daemon thread, one at a time, in arrival order per sender. Counters (written by that
    thread only): `num_received` every message, `num_rejected` those refused as malformed,
    `num_forbidden` those `authorize` refused for their sender, `num_dropped` those dropped
    undecoded from a sender past `max_strikes_per_s` refused or malformed messages in the
    current second (with `authorize`: a peer's flood of bad messages costs a lookup each, not
    a decode), `num_handler_errors` those whose handler raised."""

    def __init__(self, handler: MessageHandler, host: str = "127.0.0.1", port: int = 0, *,
                 curve: CurveKeys | None, directory: Directory | None = None,
                 authorize: Authorizer | None = None, poll_interval_s: float = 0.05,
                 log_interval_s: float = 10.0,
                 max_strikes_per_s: int = MAX_STRIKES_PER_S) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self._handler = handler
        self._authorize = authorize
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self.num_received = 0
        self.num_rejected = 0
        self.num_handler_errors = 0
        self.num_forbidden = 0
        self.num_dropped = 0
        self._strikes = _Strikes(max_strikes_per_s)
        self._forbid_log = _Throttle(log_interval_s)
        self._reject_log = _Throttle(log_interval_s)
        self._error_log = _Throttle(log_interval_s)
        self._stop = threading.Event()
        self._socket = _router_socket(host, port, curve, directory)
        # keys that depart lose their connections (core.connections)
        self._connections = None if curve is None else PeerConnections(self._socket, directory)
        self.address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        # From here on only the loop thread touches the socket (zmq sockets are not
        # thread-safe); it also closes it.
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"side-channel {self.address}")
        self._thread.start()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the loop and close the socket (ZMQ frees the port on its I/O thread a moment
        later). Idempotent; waits for a running handler call up to `timeout_s`."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("side channel %s: receive loop did not stop within %.1fs",
                             self.address, timeout_s)

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(self._poll_ms):
                    self._drain()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:  # ETERM: someone terminated the shared context
                logger.error("side channel %s: receive loop stopped: %s", self.address, exc)
        finally:
            if self._connections is not None:
                self._connections.close()
            self._socket.close(linger=0)

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_frames(frames)
            # Hand the GIL over between messages: a non-blocking receive keeps it, and under a
            # flood this loop would hold it for whole switch intervals (5 ms) against the
            # engine thread of the same process (measured: a normal request 2.2-2.8x idle
            # under a 20,000-message flood without this, 1.3-1.6x with it).
            time.sleep(0)

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.num_received += 1
        principal = None
        if self._authorize is not None and len(frames) == 2:
            principal = (MEMBER if self._connections is None
                         else self._connections.principal(frames[1]))
            if self._strikes.penalized(principal):
                self.num_dropped += 1  # a flood of bad messages: not even decoded
                return
        if len(frames) != 2:  # ROUTER prepends the sender's identity to its one frame
            self._reject(f"expected 1 frame, got {len(frames) - 1}")
            return
        try:
            msg = decode(frames[1].bytes)
        except WireError as exc:
            self._strikes.strike(principal)
            self._reject(str(exc))
            return
        if self._authorize is not None:
            reason = self._authorize(msg, principal)
            if reason is not None:
                self._strikes.strike(principal)
                self._forbid(type(msg).__name__, principal, reason)
                return
        try:
            self._handler(msg)
        except Exception:
            self.num_handler_errors += 1
            if self._error_log.ready():
                logger.exception("side channel %s: handler failed on %s (%d similar errors "
                                 "not logged)", self.address, type(msg).__name__,
                                 self._error_log.take_suppressed())

    def _forbid(self, kind: str, principal: str | None, reason: str) -> None:
        self.num_forbidden += 1
        if self._forbid_log.ready():
            logger.warning("side channel %s: refused a %s from %s: %s (%d refusals not "
                           "logged)", self.address, kind, principal or "an unknown key",
                           reason[:_REASON_CHARS], self._forbid_log.take_suppressed())

    def _reject(self, reason: str) -> None:
        self.num_rejected += 1
        if self._reject_log.ready():
            logger.warning("side channel %s: rejected a message: %s (%d rejections not logged, "
                           "%d in all)", self.address, reason[:_REASON_CHARS],
                           self._reject_log.take_suppressed(), self.num_rejected)


class _Strikes:
    """Refused or malformed messages per sender principal in the current one-second window
    (principals are registered ones: the table is as small as the cluster)."""

    def __init__(self, limit: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._limit = limit
        self._clock = clock
        self._window = 0.0
        self._counts: dict[str | None, int] = {}

    def strike(self, principal: str | None) -> None:
        self._roll()
        self._counts[principal] = self._counts.get(principal, 0) + 1

    def penalized(self, principal: str | None) -> bool:
        self._roll()
        return self._counts.get(principal, 0) >= self._limit

    def _roll(self) -> None:
        now = self._clock()
        if now - self._window >= 1.0:
            self._window, self._counts = now, {}


def _router_socket(host: str, port: int, curve: CurveKeys | None,
                   directory: Directory | None) -> zmq.Socket:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if curve is not None:
        secure_server(sock, curve, directory)
    try:
        sock.bind(f"tcp://{host}:{port or '*'}")
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock
