"""Transfers whose prefill node is lost, from the node to its connector's scheduler side.

The router tells a decode node when a request's prefill node died or refused the request
(`PrefillLost`); the node passes it on with `LostNotifier.send`, over the private folder's
`lost` socket (handshake.py), to `LostNotices` in vLLM's engine-core process. There the
scheduler side (connector_scheduler.py) meets each notice with its transfer's load, whichever
comes first: a load already registered fails in the worker at the next step, and one not
registered yet (vLLM has not scheduled the request, or not even received it) fails as it
is registered — either way vLLM recomputes the prompt at once
(`kv_load_failure_policy="recompute"`). Until then a notice waits in `LostTransfers`.

Not through the worker's side channel: that was a fire-and-forget CURVE message on a
connection the first notice opened, given up after 0.5 s — a worker that was busy just then
(a loaded machine, at the moment a prefill node dies and Ray restarts it) lost the notice, and
the decode node waited out its KV timeout. An `ipc://` socket bound before the node starts
keeps what is sent to it however long vLLM takes to look, and the step plan carries the
failure to the worker in order with the receive it fails.

API: `LostNotifier` (the node's end), `LostNotices` (the scheduler side's), `LostTransfers`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

import zmq

from pdcluster.core.kv_transfer import TransferId, XferDone, decode, encode
from pdcluster.core.wire import WireError

logger = logging.getLogger(__name__)

# A notice waits for its request's first scheduling, which a backlog in vLLM's queue can
# delay past the KV timeout. Transfer ids are the router's random ids, so a stale notice
# never fails another request: the limits only bound the memory a notice for a request that
# never comes (it ended first) can hold.
LOST_TTL_S = 600.0
MAX_LOST = 4096
_SNDHWM = 10_000


class LostTransfers:
    """Notices waiting for their transfer's load: at most `max_entries` (the oldest goes
    first), each for at most `ttl_s` on `clock`."""

    def __init__(self, ttl_s: float = LOST_TTL_S, max_entries: int = MAX_LOST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("LostTransfers needs ttl_s > 0 and max_entries >= 1")
        self._ttl_s, self._max_entries, self._clock = ttl_s, max_entries, clock
        self._entries: OrderedDict[TransferId, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def note(self, transfer_id: TransferId, reason: str) -> None:
        self._entries.pop(transfer_id, None)
        self._entries[transfer_id] = (reason, self._clock() + self._ttl_s)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def take(self, transfer_id: TransferId) -> str | None:
        """Why `transfer_id`'s source is lost (the notice is used up), or None."""
        self._expire()
        entry = self._entries.pop(transfer_id, None)
        return None if entry is None else entry[0]

    def forget(self, transfer_id: TransferId) -> None:
        self._entries.pop(transfer_id, None)

    def _expire(self) -> None:
        now = self._clock()
        while self._entries:
            transfer_id, (_, deadline) = next(iter(self._entries.items()))
            if deadline > now:
                return
            del self._entries[transfer_id]


class LostNotifier:
    """The node's end of the `lost` socket. Not thread-safe: the node server's thread sends."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._sock: zmq.Socket[bytes] | None = None

    def send(self, transfer_id: TransferId, reason: str) -> bool:
        """Queue the notice (it waits in the socket until the scheduler side reads it). False
        if it cannot be queued (tens of thousands wait already: vLLM is stuck)."""
        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            self._sock.connect(self._endpoint)
        try:
            self._sock.send(encode(XferDone(transfer_id, False, error=reason)), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("notice that transfer %s is lost not queued: %d wait already",
                           transfer_id, _SNDHWM)
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


class LostNotices:
    """The scheduler side's end of the `lost` socket (bound before vLLM reports ready, so the
    node never sends into nothing)."""

    def __init__(self, endpoint: str) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)

    def take(self) -> list[tuple[TransferId, str]]:
        """The notices that arrived since the last call: (transfer id, reason)."""
        notices: list[tuple[TransferId, str]] = []
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return notices
            try:
                msg = decode(data)
            except WireError as exc:  # only the node writes here: a bug, not an attack
                logger.error("malformed lost-transfer notice dropped: %s", exc)
                continue
            if isinstance(msg, XferDone) and not msg.ok:
                notices.append((msg.transfer_id, msg.error or "prefill node lost"))
            else:
                logger.error("unexpected %s on the lost-transfer socket", type(msg).__name__)

    def close(self) -> None:
        self._sock.close()
