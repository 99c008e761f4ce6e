"""Cluster credentials: one secret per cluster, and every credential a component presents
derived from it, so that a deployment manages exactly one value.

    secret = ClusterSecret.from_env() or ClusterSecret.generate()
    secret.curve_keys()               # the cluster's ZMQ CURVE key pair (node and KV sockets)
    secret.metadata_token("node/p0")  # what node p0 presents to the metadata service
    secret.metadata_token(SERVICE)    # what the router and launcher present
    verify_metadata_token(secret, token) -> principal | None

Derivation is HMAC-SHA256(secret, label) with a versioned label per use, so no derived value
reveals the secret or any other derived value. A principal is `SERVICE` or `node/<node id>`:
a node's token names the node, and the metadata service lets a node act only as itself, so a
stolen router token cannot register, publish or deregister as a node.

The secret comes from `$PDCLUSTER_CLUSTER_SECRET` (64+ hex characters) or from the file named
by `$PDCLUSTER_CLUSTER_SECRET_FILE` (a mounted Kubernetes Secret); `pdcluster serve` generates
one when neither is set. docs/security.md describes the trust model and how to rotate it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SECRET_ENV = "PDCLUSTER_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDCLUSTER_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 32
SERVICE = "service"  # the router, the launcher, operators' tools: read the index, not write it
NODE_PREFIX = "node/"
_LABEL_PREFIX = b"pdcluster/v1/"


class CredentialError(ValueError):
    """A secret that cannot be used (missing, malformed, too short)."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A ZMQ CURVE key pair, Z85-encoded (40 bytes each) as libzmq takes them."""

    public: bytes
    secret: bytes


@dataclass(frozen=True, slots=True)
class ClusterSecret:
    value: bytes

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_BYTES:
            raise CredentialError(f"a cluster secret needs at least {MIN_SECRET_BYTES} bytes "
                                  f"({2 * MIN_SECRET_BYTES} hex characters), got "
                                  f"{len(self.value)}")

    def __repr__(self) -> str:  # never print the secret into a log
        return "ClusterSecret(<redacted>)"

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(MIN_SECRET_BYTES))

    @classmethod
    def from_text(cls, text: str) -> ClusterSecret:
        """Parse the hex form (`to_text()`); surrounding whitespace (a file's newline) is
        ignored."""
        text = text.strip()
        try:
            value = bytes.fromhex(text)
        except ValueError:
            raise CredentialError("a cluster secret must be hex (e.g. `openssl rand -hex 32`)"
                                  ) from None
        return cls(value)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ClusterSecret:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise CredentialError(f"cannot read the cluster secret file {path}: {exc}") from exc
        return cls.from_text(text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClusterSecret | None:
        """The secret from `$PDCLUSTER_CLUSTER_SECRET`, else from the file named by
        `$PDCLUSTER_CLUSTER_SECRET_FILE`; None when neither is set."""
        env = os.environ if environ is None else environ
        if env.get(SECRET_ENV):
            return cls.from_text(env[SECRET_ENV])
        if env.get(SECRET_FILE_ENV):
            return cls.from_file(env[SECRET_FILE_ENV])
        return None

    def to_text(self) -> str:
        return self.value.hex()

    def derive(self, label: str) -> bytes:
        """32 bytes bound to this secret and `label`; distinct labels give independent keys."""
        return hmac.new(self.value, _LABEL_PREFIX + label.encode(), hashlib.sha256).digest()

    def curve_keys(self) -> CurveKeys:
        """The cluster's CURVE key pair: every member serves with it and connects with it, and
        servers admit only clients presenting its public key (core.curve)."""
        import zmq  # lazily: only ZMQ users pay for it
        from zmq.utils import z85

        secret_key = z85.encode(self.derive("curve"))
        return CurveKeys(public=zmq.curve_public(secret_key), secret=secret_key)

    def metadata_token(self, principal: str) -> str:
        """The bearer token `principal` presents to the metadata service."""
        check_principal(principal)
        return f"{principal}:{self.derive('metadata/' + principal).hex()}"


def write_secret_file(secret: ClusterSecret, path: str | os.PathLike[str]) -> Path:
    """Write the hex form to a new file readable by its owner only (0600; its folder 0700)."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        os.fchmod(file.fileno(), 0o600)  # an existing file keeps its mode through O_CREAT
        file.write(secret.to_text() + "\n")
    return path


def node_principal(node_id: str) -> str:
    return NODE_PREFIX + node_id


def check_principal(principal: str) -> None:
    if principal == SERVICE:
        return
    node_id = principal.removeprefix(NODE_PREFIX)
    if node_id == principal or not node_id or ":" in node_id:
        raise CredentialError(f"principal must be {SERVICE!r} or 'node/<id>' with no ':', "
                              f"got {principal!r}")


def verify_metadata_token(secret: ClusterSecret, token: str) -> str | None:
    """The principal `token` proves, or None if it proves nothing (constant-time compare)."""
    principal, sep, _ = token.rpartition(":")
    if not sep:
        return None
    try:
        expected = secret.metadata_token(principal)
    except CredentialError:
        return None
    return principal if hmac.compare_digest(expected.encode(), token.encode()) else None
