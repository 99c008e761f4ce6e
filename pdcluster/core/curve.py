"""ZMQ CURVE on the cluster's sockets: the node request endpoint and the KV side channel.

A server socket (`secure_server`, before `bind`) speaks CURVE with its own key pair and asks
the ZAP handler of its context about every client; the handler (`authenticator_for`, one per
context, started on first use: core.zap, which answers a known key at once and looks an
unknown one up off its thread, so strangers never delay members' handshakes) admits a client
whose public key names a principal: a key granted to the context
(`Admission.trust(key, principal)`: the shared-key mode of unit tests, principal `MEMBER`), or
one the process's key directories know (`Admission.follow(directory)`:
core.identity, fed by the metadata service). `ZAP_ENFORCE_DOMAIN` makes a missing handler a
refusal, not an open door. A client socket (`secure_client`, before `connect`) presents its own
key pair and expects the server's public key (the shared pair's own, by default). A peer
whose key names nobody cannot finish the handshake, so it can neither send nor read anything;
traffic is encrypted as a side effect (CurveZMQ: Curve25519 + XSalsa20-Poly1305).

Per message: a server reads the client's key back from each message (ZMQ's `User-Id`
property, which the ZAP handler sets to the Z85 key) with `sender_principal(context, frame)`
and authorises the message type for that principal (node/server.py, transfer/).

`Admission.num_denied` counts clients the ZAP handler refused (a client with an unknown key
but the right server key); a client without the server's key fails earlier, in the CURVE
handshake itself, and never reaches it. `stop_authenticator(context)` before terminating a
context of one's own (the process-wide `zmq.Context.instance()` is never terminated).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from pdcluster.core.credentials import CurveKeys
from pdcluster.core.identity import MEMBER, Directory
from pdcluster.core.zap import ZapServer

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "pdcluster"
# Handshakes that never complete are dropped after this instead of holding a slot.
HANDSHAKE_IVL_MS = 5_000


class Admission:
    """The ZAP policy of one context: keys granted to it, and the key directories of the
    components that serve on it (several nodes may share a process's context in tests)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trusted: dict[bytes, str] = {}
        self._directories: list[Directory] = []
        self.num_admitted = 0
        self.num_denied = 0

    def trust(self, public_key: bytes, principal: str = MEMBER) -> None:
        with self._lock:
            self._trusted[public_key] = principal

    def follow(self, directory: Directory) -> None:
        with self._lock:
            if directory not in self._directories:
                self._directories.append(directory)

    def forget(self, directory: Directory) -> None:
        with self._lock:
            if directory in self._directories:
                self._directories.remove(directory)

    def principal_of(self, public_key: bytes, wait: bool = True) -> str | None:
        """The principal a Z85 public key names, or None. `wait=False` (the per-message path)
        never asks the authority: a key its handshake admitted and the directory no longer
        names was revoked, and is refused at once."""
        with self._lock:
            principal = self._trusted.get(public_key)
            directories = list(self._directories)
        for directory in directories:
            if principal is not None:
                break
            principal = directory.principal_of(public_key, wait)
        return principal

    def admit(self, domain: str, key: bytes, wait: bool) -> bool | None:
        """The ZAP decision for a Z85 `key` (core.zap): True, False, or — without `wait` —
        None when only the directory's next refresh can tell."""
        if domain != ZAP_DOMAIN:
            ok = False
        else:
            principal = self.principal_of(key, wait)
            if principal is None and not wait:
                return None
            ok = principal is not None
        with self._lock:
            if ok:
                self.num_admitted += 1
            else:
                self.num_denied += 1
        if not ok:
            logger.warning("refused a ZMQ peer whose CURVE key names no principal (domain %r)",
                           domain)
        return ok


_lock = threading.Lock()
_handlers: dict[int, tuple[zmq.Context[Any], ZapServer, Admission]] = {}


def authenticator_for(context: zmq.Context[Any]) -> Admission:
    """The ZAP handler of `context`, started on first use (libzmq allows one per context)."""
    with _lock:
        entry = _handlers.get(id(context))
        if entry is None or entry[0] is not context:
            admission = Admission()
            entry = (context, ZapServer(context, admission.admit).start(), admission)
            _handlers[id(context)] = entry
        return entry[2]


def stop_authenticator(context: zmq.Context[Any]) -> None:
    """Stop `context`'s ZAP handler (before `context.term()`, which would wait for it)."""
    with _lock:
        entry = _handlers.pop(id(context), None)
    if entry is not None:
        entry[1].stop()


def forget_directory(directory: Directory) -> None:
    """Stop admitting the keys `directory` names, on every context (its owner stopped)."""
    with _lock:
        admissions = [entry[2] for entry in _handlers.values()]
    for admission in admissions:
        admission.forget(directory)


def secure_server(sock: zmq.Socket[Any], keys: CurveKeys,
                  directory: Directory | None = None) -> None:
    """Make `sock` (not yet bound) a CURVE server with `keys`, admitting the clients that
    `directory` names; without a directory, the holders of `keys` themselves (the shared-key
    mode: principal `MEMBER`)."""
    admission = authenticator_for(sock.context)
    if directory is None:
        admission.trust(keys.public)
    else:
        admission.follow(directory)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket[Any], keys: CurveKeys, server_key: bytes | None = None
                  ) -> None:
    """Make `sock` (not yet connected) a CURVE client presenting `keys` to the server whose
    public key is `server_key` (default: `keys.public`, the shared-key mode)."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public if server_key is None else server_key


def sender_principal(context: zmq.Context[Any], frame: zmq.Frame) -> str | None:
    """The principal of the client that sent `frame` (received with `copy=False` on a CURVE
    server socket of `context`), or None if it names nobody (any more). Never blocks: it runs
    for every message, on a node's engine thread or a side channel's receive loop."""
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:  # not a CURVE connection
        return None
    if not user_id:
        return None
    return authenticator_for(context).principal_of(str(user_id).encode(), wait=False)
