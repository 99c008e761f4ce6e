"""The metadata service as the authority on identity: which CURVE key is which principal.

Nodes: a node registers its own public key, its addresses and its transfer-engine session
under its id (`NodeInfo.curve_public_key`, `kv_session`); its bootstrap credential (the token
of principal `node/<id>`) allows that and nothing else of any other id. `Registrations`
guards a live registration: registering the id again with another epoch, key or address needs
the `registration_secret` its registration was handed (the proof of holding it), an operator's
`ReleaseNode`, or the lease to end (deregistration, expiry). An unchanged refresh needs nothing.
A registration without a key (the shared-key test mode) is not guarded.

Routers: `ClientKeys` holds the keys routers register (principal `router/<client id>`), each
under a lease renewed by registering again, at most `max_clients` of them.

API: `Registrations`, `RegistrationConflict`, `ClientKeys`, `check_client_key`.
"""

from __future__ import annotations

import hmac
import re
import secrets
import time
from collections.abc import Callable

from pdcluster.metadata_service.errors import InvalidBatch, MetadataError
from pdcluster.proto import metadata_pb2 as pb

_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_Z85 = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_GUARDED_FIELDS = ("epoch", "curve_public_key", "request_address", "kv_address", "kv_session")


class RegistrationConflict(MetadataError):
    """A registration that would take over a live one without its proof (PERMISSION_DENIED)."""


def check_curve_key(key: str, where: str) -> None:
    if key and not _Z85.fullmatch(key):
        raise InvalidBatch("bad_key", f"{where}: a CURVE public key is 40 Z85 characters")


class Registrations:
    """The proofs of live node registrations, by node id."""

    def __init__(self) -> None:
        self._secrets: dict[str, bytes] = {}

    def admit(self, live: pb.NodeInfo | None, info: pb.NodeInfo, proof: bytes) -> bytes:
        """Check `info` against the live registration of its id (None: there is none);
        returns the new registration's secret, or b"" for an unchanged refresh."""
        node_id = info.node_id
        if live is not None and live.curve_public_key and _changed(live, info):
            held = self._secrets.get(node_id, b"")
            if not (proof and held and hmac.compare_digest(proof, held)):
                raise RegistrationConflict(
                    f"node id {node_id!r} is registered (live) with another epoch, key or "
                    "address: taking it over needs that registration's proof, its lease to "
                    "end, or an operator's ReleaseNode")
        elif live is not None and node_id in self._secrets:
            return b""  # an unchanged refresh (or a keyless one): the holder has its proof
        secret = secrets.token_bytes(32)
        self._secrets[node_id] = secret
        return secret

    def forget(self, node_id: str) -> None:
        self._secrets.pop(node_id, None)


def _changed(live: pb.NodeInfo, info: pb.NodeInfo) -> bool:
    return any(getattr(live, name) != getattr(info, name) for name in _GUARDED_FIELDS)


class ClientKeys:
    """Routers' CURVE keys under leases, by client id."""

    def __init__(self, max_clients: int = 64, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.max_clients = max_clients
        self._clock = clock
        self._keys: dict[str, tuple[pb.ClientKey, float]] = {}

    def register(self, key: pb.ClientKey, ttl_s: int) -> None:
        if not _CLIENT_ID.fullmatch(key.client_id):
            raise InvalidBatch("bad_client_id", f"client_id {key.client_id[:80]!r} must match "
                               f"{_CLIENT_ID.pattern}")
        if not key.curve_public_key:
            raise InvalidBatch("bad_key", "a client registers its CURVE public key")
        check_curve_key(key.curve_public_key, f"client {key.client_id}")
        self._expire()
        if key.client_id not in self._keys and len(self._keys) >= self.max_clients:
            raise InvalidBatch("too_many_clients", f"{self.max_clients} client keys are "
                               "registered already")
        stored = pb.ClientKey()
        stored.CopyFrom(key)
        self._keys[key.client_id] = (stored, self._clock() + ttl_s)

    def list(self) -> list[pb.ClientKey]:
        self._expire()
        return [key for key, _ in self._keys.values()]

    def _expire(self) -> None:
        now = self._clock()
        for client_id in [c for c, (_, deadline) in self._keys.items() if deadline <= now]:
            del self._keys[client_id]
