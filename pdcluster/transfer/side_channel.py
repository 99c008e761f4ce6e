"""The side channel: ZMQ + msgpack control messages between nodes (XferRequest, XferAbort,
XferDone from `core.kv_transfer`). Each message is one frame of `encode(msg)`; nothing else
(de)serialises here, and nothing is pickled.

API:
- `SideChannelServer(handler, host="127.0.0.1", port=0, *, curve=keys)`: a ROUTER socket
  (`.address` is "tcp://host:port"; port 0 picks a free one) drained by a daemon thread that
  decodes each frame and calls `handler(msg)`. Bad frames are rejected and counted
  (`.num_rejected`), handler exceptions are counted (`.num_handler_errors`); neither stops
  the loop. `close()` returns within about `poll_interval_s`. Context manager.
- `SideChannelClient(send_timeout_s=0.5, *, curve=keys)`: `send(address, msg)`, fire and
  forget, over one cached DEALER socket per address; thread-safe. `close()`.

Authentication: with `curve` (the cluster's key pair, `ClusterSecret.curve_keys()`), both ends
speak ZMQ CURVE (core.curve): a peer without the cluster's keys cannot complete the handshake,
so it can send nothing (no forged XferRequest, XferDone or PrefixPullRequest) and read nothing.
`curve=None` is plaintext, for unit tests of this room only; nodes always pass the keys.

Delivery: `send` returning means the message was queued for a connected peer, not that it was
handled. If no peer is connected at `address` within `send_timeout_s`, `send` raises
`TransferError`; it never blocks longer. `close()` drops messages still queued (LINGER=0).
Both sides share the process's `zmq.Context.instance()` and close only their own sockets.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_client, secure_server
from pdcluster.core.kv_transfer import MAX_MESSAGE_BYTES, SideChannelMessage, decode, encode
from pdcluster.core.wire import WireError
from pdcluster.transfer.errors import TransferError

logger = logging.getLogger(__name__)

MessageHandler = Callable[[SideChannelMessage], None]
# Frames beyond this are dropped by ZMQ itself (it disconnects the sender) before any memory
# is spent; frames between MAX_MESSAGE_BYTES and this are received and counted as rejected.
MAX_FRAME_BYTES = 2 * MAX_MESSAGE_BYTES
_SEND_HWM = 10_000
_REASON_CHARS = 200


class _Throttle:
    """Allows a log line at most once per `interval_s`; counts what it suppressed."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self.suppressed = 0

    def ready(self) -> bool:
        now = self._clock()
        if now < self._next:
            self.suppressed += 1
            return False
        self._next = now + self._interval_s
        return True

    def take_suppressed(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count


class SideChannelServer:
    """Receives side-channel messages on a ROUTER socket and hands them to `handler` on a
    daemon thread, one at a time, in arrival order per sender. Counters (written by that
    thread only): `num_received` every message, `num_rejected` those refused as malformed,
    `num_handler_errors` those whose handler raised."""

    def __init__(self, handler: MessageHandler, host: str = "127.0.0.1", port: int = 0, *,
                 curve: CurveKeys | None, poll_interval_s: float = 0.05,
                 log_interval_s: float = 10.0) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {port}")
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self._handler = handler
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self.num_received = 0
        self.num_rejected = 0
        self.num_handler_errors = 0
        self._reject_log = _Throttle(log_interval_s)
        self._error_log = _Throttle(log_interval_s)
        self._stop = threading.Event()
        self._socket = _router_socket(host, port, curve)
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
            self._socket.close(linger=0)

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_frames(frames)

    def _on_frames(self, frames: list[bytes]) -> None:
        self.num_received += 1
        if len(frames) != 2:  # ROUTER prepends the sender's identity to its one frame
            self._reject(f"expected 1 frame, got {len(frames) - 1}")
            return
        try:
            msg = decode(frames[1])
        except WireError as exc:
            self._reject(str(exc))
            return
        try:
            self._handler(msg)
        except Exception:
            self.num_handler_errors += 1
            if self._error_log.ready():
                logger.exception("side channel %s: handler failed on %s (%d similar errors "
                                 "not logged)", self.address, type(msg).__name__,
                                 self._error_log.take_suppressed())

    def _reject(self, reason: str) -> None:
        self.num_rejected += 1
        if self._reject_log.ready():
            logger.warning("side channel %s: rejected a message: %s (%d rejections not logged, "
                           "%d in all)", self.address, reason[:_REASON_CHARS],
                           self._reject_log.take_suppressed(), self.num_rejected)


def _router_socket(host: str, port: int, curve: CurveKeys | None) -> zmq.Socket:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if curve is not None:
        secure_server(sock, curve)
    try:
        sock.bind(f"tcp://{host}:{port or '*'}")
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


class SideChannelClient:
    """Sends side-channel messages, fire and forget. One DEALER socket per destination,
    created on first use and guarded by its own lock, so a slow peer holds up only its own
    senders."""

    def __init__(self, send_timeout_s: float = 0.5, *, curve: CurveKeys | None) -> None:
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be positive, got {send_timeout_s}")
        self._send_timeout_ms = max(1, round(send_timeout_s * 1000))
        self._curve = curve
        self._lock = threading.Lock()
        self._sockets: dict[str, tuple[zmq.Socket, threading.Lock]] = {}
        self._closed = False

    def send(self, address: str, msg: SideChannelMessage) -> None:
        """Queue `msg` for `address` ("tcp://host:port"). Raises `TransferError` if no peer is
        connected there within the send timeout, `WireError` if `msg` is too large."""
        payload = encode(msg)
        if len(payload) > MAX_MESSAGE_BYTES:
            raise WireError(f"{type(msg).__name__} of {len(payload)} bytes exceeds "
                            f"{MAX_MESSAGE_BYTES}")
        sock, lock = self._socket_for(address)
        with lock:
            if self._closed:
                raise TransferError("side-channel client is closed")
            try:
                sock.send(payload, 0, copy=len(payload) < 65536)
            except zmq.Again:
                raise TransferError(f"no side-channel peer accepted a message at {address} "
                                    f"within {self._send_timeout_ms} ms") from None

    def close(self) -> None:
        """Close every socket (queued messages are dropped). Idempotent."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets.values()), {}
        for sock, lock in sockets:
            with lock:
                sock.close(linger=0)

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _socket_for(self, address: str) -> tuple[zmq.Socket, threading.Lock]:
        with self._lock:
            if self._closed:
                raise TransferError("side-channel client is closed")
            entry = self._sockets.get(address)
            if entry is None:
                entry = (self._dealer_socket(address), threading.Lock())
                self._sockets[address] = entry
            return entry

    def _dealer_socket(self, address: str) -> zmq.Socket:
        if not address.startswith("tcp://"):
            raise ValueError(f"side-channel address must be tcp://host:port, got {address!r}")
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # IMMEDIATE: queue only on completed connections, so a dead peer makes send time out
        # instead of piling messages up; SNDTIMEO also covers a connection still being made.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        if self._curve is not None:
            secure_client(sock, self._curve)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"bad side-channel address {address!r}: {exc}") from exc
        return sock
