"""ZMQ CURVE on the cluster's sockets: the node request endpoint and the KV side channel.

A server socket (`secure_server`, before `bind`) speaks CURVE with the cluster key pair and
asks the ZAP handler of its context about every client; the handler (`authenticator_for`, one
per context, started on first use) admits only clients presenting a public key it was told
to trust, i.e. the cluster's. `ZAP_ENFORCE_DOMAIN` makes a missing handler a refusal, not an
open door. A client socket (`secure_client`, before `connect`) presents the cluster key pair
and expects the server to hold the cluster's key. A peer without the key pair cannot finish
the handshake, so it can neither send nor read anything; traffic is encrypted as a side
effect (CurveZMQ: Curve25519 + XSalsa20-Poly1305).

`Admission.num_denied` counts clients the ZAP handler refused (a client with the wrong key pair
but the right server key); a client without the server's key fails earlier, in the CURVE
handshake itself, and never reaches it. `stop_authenticator(context)` before terminating a
context of one's own (the process-wide `zmq.Context.instance()` is never terminated).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pdcluster.core.credentials import CurveKeys

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "pdcluster"
# Handshakes that never complete are dropped after this instead of holding a slot.
HANDSHAKE_IVL_MS = 5_000


class Admission:
    """The ZAP policy of one context: the CURVE public keys it admits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._trusted: set[bytes] = set()
        self.num_admitted = 0
        self.num_denied = 0

    def trust(self, public_key: bytes) -> None:
        with self._lock:
            self._trusted.add(public_key)

    def callback(self, domain: str, key: bytes) -> bool:  # called by pyzmq's ZAP thread
        with self._lock:
            ok = domain == ZAP_DOMAIN and key in self._trusted
            if ok:
                self.num_admitted += 1
            else:
                self.num_denied += 1
        if not ok:
            logger.warning("refused a ZMQ peer without the cluster's CURVE key (domain %r)",
                           domain)
        return ok


_lock = threading.Lock()
_handlers: dict[int, tuple[zmq.Context[Any], ThreadAuthenticator, Admission]] = {}


def authenticator_for(context: zmq.Context[Any]) -> Admission:
    """The ZAP handler of `context`, started on first use (libzmq allows one per context)."""
    with _lock:
        entry = _handlers.get(id(context))
        if entry is None or entry[0] is not context:
            auth = ThreadAuthenticator(context, log=logging.getLogger("zmq.auth"))
            auth.start()
            admission = Admission()
            auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=admission)
            entry = (context, auth, admission)
            _handlers[id(context)] = entry
        return entry[2]


def stop_authenticator(context: zmq.Context[Any]) -> None:
    """Stop `context`'s ZAP handler (before `context.term()`, which would wait for it)."""
    with _lock:
        entry = _handlers.pop(id(context), None)
    if entry is not None:
        entry[1].stop()


def secure_server(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make `sock` (not yet bound) a CURVE server admitting only holders of `keys`."""
    authenticator_for(sock.context).trust(keys.public)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket[Any], keys: CurveKeys) -> None:
    """Make `sock` (not yet connected) a CURVE client presenting `keys` to a cluster server."""
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public
