"""Closing the CURVE connections of keys that left the directory.

ZAP checks a client's key once, at its handshake; a connection then lives as long as TCP does.
A node whose key was revoked (deregistered, replaced, its lease ended) would keep its
connections, and every message on them would be refused one by one. libzmq has no call to drop
one peer of a ROUTER socket, but each received message names the descriptor it came on
(`ZMQ_SRCFD`), so a server can remember, per connection, the client key and the TCP peer, and
shut that TCP connection down when the key departs: libzmq sees the peer gone and closes its
side, and the client's reconnect meets ZAP, which refuses the departed key.

`PeerConnections(sock, directory)` does this for one CURVE server socket: `principal(frame)` is
the per-message lookup (`core.curve.sender_principal`) that also notes the connection, and
closes it at once when its key names nobody any more; a subscription to the directory closes
every noted connection of a key as soon as a refresh drops it (after the directory's grace).
A descriptor is shut down only while it still is the TCP connection that was noted (same peer
address and port): a descriptor libzmq closed and the kernel reused is left alone.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import zmq

from pdcluster.core.curve import sender_principal
from pdcluster.core.identity import Directory, Peer

logger = logging.getLogger(__name__)

_Endpoint = tuple[Any, ...]  # a socket's getpeername()


class PeerConnections:
    """The CURVE connections of one server socket, by client key (see the module doc).
    `num_closed` counts connections shut down because their key departed."""

    def __init__(self, sock: zmq.Socket[Any], directory: Directory | None) -> None:
        self._context = sock.context
        self._directory = directory
        self._lock = threading.Lock()
        self._by_fd: dict[int, tuple[bytes, _Endpoint]] = {}
        self.num_closed = 0
        if directory is not None:
            directory.subscribe(self._on_peers)

    def principal(self, frame: zmq.Frame) -> str | None:
        """The principal of `frame`'s sender (`sender_principal`); a connection whose key
        names nobody any more is closed before returning None."""
        principal = sender_principal(self._context, frame)
        key, fd = _key_and_fd(frame)
        if key is None or fd is None:
            return principal
        with self._lock:
            noted = self._by_fd.get(fd)
            if noted is None or noted[0] != key:
                peer = _peer_of(fd)
                if peer is not None:
                    self._by_fd[fd] = (key, peer)
                    noted = self._by_fd[fd]
            if principal is None and noted is not None:
                self._shut(fd, noted)
        return principal

    def close(self) -> None:
        """Stop following the directory (the server socket is closing)."""
        if self._directory is not None:
            self._directory.unsubscribe(self._on_peers)

    def _on_peers(self, peers: list[Peer]) -> None:
        known = {peer.public_key for peer in peers}
        with self._lock:
            for fd, noted in list(self._by_fd.items()):
                if noted[0] not in known:
                    self._shut(fd, noted)

    def _shut(self, fd: int, noted: tuple[bytes, _Endpoint]) -> None:
        del self._by_fd[fd]
        if _peer_of(fd) != noted[1]:
            return  # libzmq closed it already; the number may name another connection now
        try:
            with socket.socket(fileno=os.dup(fd)) as conn:
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        self.num_closed += 1
        logger.warning("closed a connection from %s: its CURVE key %s names no principal "
                       "any more", noted[1], noted[0][:8].decode(errors="replace"))


def _key_and_fd(frame: zmq.Frame) -> tuple[bytes | None, int | None]:
    try:
        user_id = frame.get("User-Id")
        fd = frame.get(zmq.SRCFD)
    except zmq.ZMQError:  # not a CURVE connection, or a libzmq without the property
        return None, None
    return (str(user_id).encode() if user_id else None), (fd if fd >= 0 else None)


def _peer_of(fd: int) -> _Endpoint | None:
    """The TCP peer of descriptor `fd`, or None if it is no connected socket."""
    try:
        with socket.socket(fileno=os.dup(fd)) as conn:
            return tuple(conn.getpeername())
    except OSError:
        return None
