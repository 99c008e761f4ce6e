"""`SideChannelClient`: sends side-channel messages (core.kv_transfer) to peers' side-channel
servers, fire and forget, without ever blocking its caller.

    client = SideChannelClient(curve=keys)
    client.send("tcp://10.0.0.7:5600", XferAbort("t-1"), on_failure=lambda why: ...)
    client.close()

`send` checks the address and encodes the message in the caller's thread (`ValueError` for a
bad address, `WireError` for a message the wire cannot carry, `TransferError` once closed or
when `max_queued` messages already wait) and queues it; it never waits on the network. One
sender thread delivers: one DEALER socket per destination, messages to one destination in
order. A destination with no connected peer (`IMMEDIATE`: nothing is queued on a connection
still being made) is retried without holding up the others, and after `send_timeout_s` its
messages fail: `on_failure(reason)` runs on the sender thread. So a dead reply address costs
the engine thread nothing, and the messages to live peers go out meanwhile.

Bounded per peer-chosen value: at most `max_peers` sockets are open (past that one is closed,
preferring those that never delivered anything; `num_evicted` counts them), and at most
`max_queued` messages wait in all. A peer naming 10,000 reply addresses therefore costs
`max_peers` sockets, not 10,000. Nor can they crowd out the live peers: messages to addresses
that have not delivered anything yet may fill at most half of `max_queued`, so a flood of dead
addresses leaves the other half to the peers already proven live.

Authentication: with `curve`, each socket is a CURVE client presenting that key pair and
expecting the server key `server_key_for(address)` (default: the pair's own public key, the
shared-key mode of unit tests); messages to an address whose key is unknown wait for it (the
lookup is retried) until their deadline, then fail (`on_failure`).
`close()` drops what is still queued (LINGER=0) and joins the sender thread.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.curve import secure_client
from pdcluster.core.kv_transfer import MAX_MESSAGE_BYTES, SideChannelMessage, encode
from pdcluster.core.throttle import Throttle
from pdcluster.core.types import MAX_ADDRESS_CHARS
from pdcluster.core.wire import WireError
from pdcluster.transfer.errors import TransferError

logger = logging.getLogger(__name__)

FailureHandler = Callable[[str], None]
ServerKeyLookup = Callable[[str], bytes | None]
_SEND_HWM = 10_000
_RETRY_MS = 2  # how often a destination without a connected peer is tried again
_NEW_SOCKETS_PER_PASS = 16
_RECONNECT_IVL_MAX_MS = 5_000  # back off reconnecting to a dead peer up to this


class _UnknownPeer(ValueError):
    """No key is known for the address (yet): its messages wait until their deadline."""


@dataclass(slots=True)
class _Outgoing:
    payload: bytes
    deadline: float
    on_failure: FailureHandler | None
    unproven: bool = False  # queued for an address that had delivered nothing yet


class SideChannelClient:
    def __init__(self, send_timeout_s: float = 0.5, *, curve: CurveKeys | None,
                 server_key_for: ServerKeyLookup | None = None, max_peers: int = 256,
                 max_queued: int = 10_000) -> None:
        if send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be positive, got {send_timeout_s}")
        if max_peers < 1 or max_queued < 1:
            raise ValueError("max_peers and max_queued must be >= 1")
        self._send_timeout_s = send_timeout_s
        self._curve = curve
        self._server_key_for = server_key_for
        self._max_peers, self._max_queued = max_peers, max_queued
        self._cond = threading.Condition()
        self._incoming: deque[tuple[str, _Outgoing]] = deque()
        self._num_queued = 0  # incoming + pending, guarded by _cond
        # of those, the ones for addresses not (yet) in _proven: at most half the queue
        self._num_unproven, self._max_unproven = 0, max(1, max_queued // 2)
        self._proven: set[str] = set()  # addresses with a live socket, guarded by _cond
        self._closed = False
        self.num_failed = 0
        self.num_evicted = 0
        self._failure_log = Throttle()
        # owned by the sender thread (zmq sockets are not thread-safe)
        # one socket per destination, least recently used first: those that never delivered
        # a message (a dead or made-up address: evicted first), and the live peers
        self._fresh: OrderedDict[str, zmq.Socket[Any]] = OrderedDict()
        self._live: OrderedDict[str, zmq.Socket[Any]] = OrderedDict()
        self._pending: dict[str, deque[_Outgoing]] = {}
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="side-channel-send")
        self._thread.start()

    @property
    def num_sockets(self) -> int:
        return len(self._fresh) + len(self._live)

    def send(self, address: str, msg: SideChannelMessage,
             on_failure: FailureHandler | None = None) -> None:
        """Queue `msg` for `address` ("tcp://host:port"); see the module docstring."""
        if not address.startswith("tcp://") or len(address) > MAX_ADDRESS_CHARS:
            raise ValueError(f"side-channel address must be tcp://host:port of at most "
                             f"{MAX_ADDRESS_CHARS} characters, got {address[:80]!r}")
        payload = encode(msg)
        if len(payload) > MAX_MESSAGE_BYTES:
            raise WireError(f"{type(msg).__name__} of {len(payload)} bytes exceeds "
                            f"{MAX_MESSAGE_BYTES}")
        deadline = time.monotonic() + self._send_timeout_s
        with self._cond:
            if self._closed:
                raise TransferError("side-channel client is closed")
            unproven = address not in self._proven
            if self._num_queued >= self._max_queued or \
                    (unproven and self._num_unproven >= self._max_unproven):
                raise TransferError(f"{self._num_queued} side-channel messages already wait "
                                    f"to be sent ({self._num_unproven} to addresses that "
                                    "delivered nothing yet)")
            self._num_queued += 1
            self._num_unproven += unproven
            self._incoming.append((address, _Outgoing(payload, deadline, on_failure,
                                                      unproven)))
            self._cond.notify()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the sender and close every socket (queued messages are dropped). Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> SideChannelClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the sender thread --------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._take_incoming():
                self._deliver()
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:  # ETERM: someone terminated the shared context
                logger.error("side-channel sender stopped: %s", exc)
        finally:
            for sock in (*self._fresh.values(), *self._live.values()):
                sock.close(linger=0)
            self._fresh.clear()
            self._live.clear()

    def _take_incoming(self) -> bool:
        """Move newly queued messages to the per-destination queues; False once closed."""
        with self._cond:
            if not self._incoming and not self._closed:
                self._cond.wait(_RETRY_MS / 1000 if self._pending else None)
            if self._closed:
                return False
            incoming, self._incoming = self._incoming, deque()
        # a pass is short even under a flood: new addresses wait in _pending, not here
        for address, out in incoming:
            self._pending.setdefault(address, deque()).append(out)
        return True

    def _deliver(self) -> None:
        """One pass over the destinations with queued messages: connected ones first, then
        at most `_NEW_SOCKETS_PER_PASS` new ones, so that a flood of new addresses delays
        the known peers by one pass at most (and costs each pass a bounded amount)."""
        now = time.monotonic()
        known = [a for a in (*self._live, *self._fresh) if a in self._pending]
        new = list(itertools.islice((a for a in self._pending if a not in self._live
                                     and a not in self._fresh), _NEW_SOCKETS_PER_PASS))
        for address in known + new:
            queue = self._pending.get(address)
            if queue is None:
                continue  # its socket was evicted (and its messages failed) this pass
            self._send_queued(address, queue, now)
            if not queue:
                del self._pending[address]

    def _send_queued(self, address: str, queue: deque[_Outgoing], now: float) -> None:
        sock = self._socket_for(address, queue)
        while sock is not None and queue:
            try:
                sock.send(queue[0].payload, zmq.NOBLOCK, copy=len(queue[0].payload) < 65536)
            except zmq.Again:
                if queue[0].deadline > now:
                    return  # not connected yet: try again soon, the others go on
                self._fail(queue.popleft(), f"no side-channel peer accepted a message at "
                           f"{address} within {self._send_timeout_s * 1000:.0f} ms")
                # a fresh socket next time: libzmq never retries a refused handshake
                self._close(address)
                sock = self._socket_for(address, queue) if queue else None
                continue
            self._done(queue.popleft())
            if address in self._fresh:  # it delivered: a live peer from now on
                self._live[address] = self._fresh.pop(address)
                with self._cond:
                    self._proven.add(address)

    def _socket_for(self, address: str, queue: deque[_Outgoing]) -> zmq.Socket[Any] | None:
        for sockets in (self._live, self._fresh):
            sock = sockets.get(address)
            if sock is not None:
                sockets.move_to_end(address)
                return sock
        try:
            sock = self._dealer_socket(address)
        except _UnknownPeer as exc:  # maybe registered a moment ago: ask again next pass
            now = time.monotonic()
            while queue and queue[0].deadline <= now:
                self._fail(queue.popleft(), str(exc))
            return None
        except ValueError as exc:
            while queue:
                self._fail(queue.popleft(), str(exc))
            return None
        if self.num_sockets >= self._max_peers:
            self._evict()
        self._fresh[address] = sock
        return sock

    def _evict(self) -> None:
        """Close one socket: the least recently used one that never delivered a message (a
        dead or made-up address), else the least recently used live one. So a flood of new
        addresses cannot push out the live peers. O(1)."""
        victim = next(iter(self._fresh or self._live))
        self._close(victim)
        self.num_evicted += 1
        for out in self._pending.pop(victim, deque()):
            self._fail(out, f"side-channel socket to {victim} closed: more than "
                       f"{self._max_peers} peers")

    def _close(self, address: str) -> None:
        sock = self._fresh.pop(address, None) or self._live.pop(address)
        sock.close(linger=0)
        with self._cond:
            self._proven.discard(address)

    def _dealer_socket(self, address: str) -> zmq.Socket[Any]:
        server_key = None
        if self._curve is not None:
            lookup = self._server_key_for
            server_key = self._curve.public if lookup is None else lookup(address)
            if server_key is None:
                raise _UnknownPeer(f"no registered node serves the side channel at {address}")
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # a side-channel server sends nothing back
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_IVL_MAX_MS)
        if self._curve is not None and server_key is not None:
            secure_client(sock, self._curve)
            sock.curve_serverkey = server_key
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"bad side-channel address {address!r}: {exc}") from exc
        return sock

    def _fail(self, out: _Outgoing, reason: str) -> None:
        self._done(out)
        self.num_failed += 1
        if out.on_failure is None:
            if self._failure_log.ready():
                logger.warning("side-channel send failed: %s (%d similar failures not logged)",
                               reason, self._failure_log.take_suppressed())
            return
        try:
            out.on_failure(reason)
        except Exception:  # a caller's bug must not stop the sender
            logger.exception("side-channel failure handler raised")

    def _done(self, out: _Outgoing) -> None:
        with self._cond:
            self._num_queued -= 1
            self._num_unproven -= out.unproven
