"""The metadata service as the authority on identity: which CURVE key is which principal.

Nodes: a node registers its own public key, its addresses and its transfer-engine session
under its id (`NodeInfo.curve_public_key`, `kv_session`); its bootstrap credential (the token
of principal `node/<id>`) allows that and nothing else of any other id. A live registration
with a key is guarded by its proof: the `registration_secret` handed to whoever created it.
The service keeps only the proof's hash (`proof_hash`), with the node's record — in etcd with
the etcd backend — so every replica, and a restarted one, enforces it (`check_proof`):

- registering the id again with anything changed — epoch, key, addresses, session, its KV
  identity or capacity — needs the proof (or an operator's `ReleaseNode`, or the lease to
  end);
- an unchanged refresh needs nothing, and creates no proof (`new_proof` returns None): a
  replica that never saw the secret cannot be talked into minting another;
- deregistering needs the proof.

A registration without a key (the shared-key test mode) is not guarded. Live registrations
are unique (`check_unique`): no two live nodes share a key, request or KV address or
transfer-engine session, and no node shares a router's key, so no member can pass the side
channel's checks as another or break its transfers.

Routers: `ClientKeys` holds the keys routers register (principal `router/<client id>`), each
under a lease renewed by registering again, at most `max_clients` of them. Keys registered on
another replica come from etcd (`remote_up` / `remote_down`) and leave when etcd's lease does.

Which ids may register at all: `check_allowed`, against the service's allowlist per role
(`MetadataConfig.node_allowlist`; the chart lists the ids its launcher starts), and how many:
`check_count` (`MetadataConfig.max_nodes`; the chart's bound when a planner names the nodes).

API: `RegistrationConflict`, `check_curve_key`, `proof_hash`, `check_proof`, `new_proof`,
`identity_changed`, `check_unique`, `check_allowed`, `check_count`, `ClientKeys`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping

from pdcluster.core.pull_ticket import PUBLIC_KEY_BYTES
from pdcluster.metadata_service.errors import InvalidBatch, MetadataError
from pdcluster.proto import metadata_pb2 as pb

_CLIENT_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
_Z85 = re.compile(r"[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}")
_UNIQUE_FIELDS = ("curve_public_key", "request_address", "kv_address", "kv_session")
_FOREVER = float("inf")
_ROLE_NAMES = {pb.PREFILL: "prefill", pb.DECODE: "decode"}


class RegistrationConflict(MetadataError):
    """A registration or deregistration that would take over, remove or shadow a live one
    without its proof (PERMISSION_DENIED)."""


def check_curve_key(key: str, where: str) -> None:
    if key and not _Z85.fullmatch(key):
        raise InvalidBatch("bad_key", f"{where}: a CURVE public key is 40 Z85 characters")


def proof_hash(proof: bytes) -> bytes:
    return hashlib.sha256(proof).digest()


def is_guarded(live: pb.NodeInfo | None) -> bool:
    return live is not None and bool(live.curve_public_key)


def identity_changed(live: pb.NodeInfo, info: pb.NodeInfo) -> bool:
    """Anything declared differently — epoch, key, addresses, session, KV identity (model,
    block size, hashing, tokenizer), role, capacity: a new incarnation as far as anyone
    relying on it goes (the router would hash its blocks, or price it, differently). Its
    drain state is not declared, so not compared."""
    return declared(live) != declared(info)


def declared(info: pb.NodeInfo) -> pb.NodeInfo:
    """`info` without its state (`draining`): what the node declares about itself."""
    if not info.draining:
        return info
    copy = pb.NodeInfo()
    copy.CopyFrom(info)
    copy.draining = False
    return copy


def check_proof(live: pb.NodeInfo | None, held_hash: bytes, proof: bytes, what: str) -> None:
    """Raise RegistrationConflict unless `proof` is the proof of the live registration
    `live` (None: there is none; an unguarded one needs none)."""
    if not is_guarded(live):
        return
    if proof and held_hash and hmac.compare_digest(proof_hash(proof), held_hash):
        return
    assert live is not None, "is_guarded checked it"
    raise RegistrationConflict(
        f"node id {live.node_id!r} is registered (live): {what} needs that registration's "
        "proof, its lease to end, or an operator's ReleaseNode")


def new_proof(live: pb.NodeInfo | None, info: pb.NodeInfo) -> bytes | None:
    """A fresh proof when `info` creates a registration (none live, or a changed one the
    caller was allowed to make); None for an unchanged refresh, which keeps the old one."""
    if live is not None and not identity_changed(live, info):
        return None
    return secrets.token_bytes(32)


def check_allowed(info: pb.NodeInfo, allowlist: Mapping[str, frozenset[str]] | None) -> None:
    """Refuse a node id the allowlist (role name -> ids; None: any id) does not name for the
    node's role: a stolen way to mint tokens cannot add nodes the operator did not plan."""
    if allowlist is None:
        return
    role = _ROLE_NAMES.get(info.role, "")
    if info.node_id not in allowlist.get(role, frozenset()):
        raise RegistrationConflict(f"node id {info.node_id!r} is not on the {role or 'unknown'} "
                                   "allowlist of this metadata service (--allow-nodes)")


def check_count(info: pb.NodeInfo, live: Iterable[pb.NodeInfo],
                max_nodes: Mapping[str, int] | None) -> None:
    """Refuse a new node of a role that has its `max_nodes` live ones already."""
    role = _ROLE_NAMES.get(info.role, "")
    if max_nodes is None or role not in max_nodes:
        return
    if sum(1 for n in live if n.role == info.role) >= max_nodes[role]:
        raise RegistrationConflict(f"node {info.node_id!r}: the {role} role has its "
                                   f"{max_nodes[role]} live nodes already (--max-nodes)")


def check_unique(info: pb.NodeInfo, live: Iterable[pb.NodeInfo],
                 router_keys: Iterable[str]) -> None:
    """Refuse `info` if another live node registered one of its key, addresses or session,
    or a router registered its key."""
    for other in live:
        if other.node_id == info.node_id:
            continue
        for name in _UNIQUE_FIELDS:
            value = getattr(info, name)
            if value and value == getattr(other, name):
                raise RegistrationConflict(
                    f"node {info.node_id!r}: its {name} is already registered by live node "
                    f"{other.node_id!r}")
    if info.curve_public_key and info.curve_public_key in set(router_keys):
        raise RegistrationConflict(f"node {info.node_id!r}: its curve_public_key is already "
                                   "registered by a router")


class ClientKeys:
    """Routers' CURVE keys under leases, by client id: those registered here (a deadline on
    this replica's clock) and those another replica registered (etcd says when they go)."""

    def __init__(self, max_clients: int = 64, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.max_clients = max_clients
        self._clock = clock
        self._keys: dict[str, tuple[pb.ClientKey, float]] = {}

    def register(self, key: pb.ClientKey, ttl_s: int, node_keys: Iterable[str] = ()) -> None:
        if not _CLIENT_ID.fullmatch(key.client_id):
            raise InvalidBatch("bad_client_id", f"client_id {key.client_id[:80]!r} must match "
                               f"{_CLIENT_ID.pattern}")
        if not key.curve_public_key:
            raise InvalidBatch("bad_key", "a client registers its CURVE public key")
        check_curve_key(key.curve_public_key, f"client {key.client_id}")
        if len(key.ticket_public_key) not in (0, PUBLIC_KEY_BYTES):
            raise InvalidBatch("bad_key", f"client {key.client_id}: ticket_public_key must be "
                               f"{PUBLIC_KEY_BYTES} bytes (Ed25519) or empty")
        self._expire()
        if key.curve_public_key in set(node_keys) or any(
                other.curve_public_key == key.curve_public_key and client_id != key.client_id
                for client_id, (other, _) in self._keys.items()):
            raise RegistrationConflict(f"client {key.client_id!r}: its curve_public_key is "
                                       "already registered by a live node or another router")
        if key.client_id not in self._keys and len(self._keys) >= self.max_clients:
            raise InvalidBatch("too_many_clients", f"{self.max_clients} client keys are "
                               "registered already")
        self._put(key, self._clock() + ttl_s)

    def remote_up(self, key: pb.ClientKey) -> None:
        """Another replica registered (or renewed) it: it lives until etcd deletes it."""
        self._put(key, _FOREVER)

    def remote_down(self, client_id: str) -> None:
        self._keys.pop(client_id, None)

    def _put(self, key: pb.ClientKey, deadline: float) -> None:
        stored = pb.ClientKey()
        stored.CopyFrom(key)
        self._keys[key.client_id] = (stored, deadline)

    def list(self) -> list[pb.ClientKey]:
        self._expire()
        return [key for key, _ in self._keys.values()]

    def public_keys(self) -> set[str]:
        return {key.curve_public_key for key in self.list()}

    def _expire(self) -> None:
        now = self._clock()
        for client_id in [c for c, (_, deadline) in self._keys.items() if deadline <= now]:
            del self._keys[client_id]
