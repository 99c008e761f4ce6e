"""Cluster credentials: one root secret per cluster, held by the metadata service and the
launcher only, and the credentials they hand out, each good for one principal.

    secret = ClusterSecret.from_env() or ClusterSecret.generate()
    secret.metadata_token("node/p0")  # node p0's bootstrap credential (only p0 gets it)
    secret.metadata_token(SERVICE)    # the router's client credential
    secret.metadata_token(OPERATOR)   # an operator's (release a node id's registration)
    verify_metadata_token(secret, token) -> principal | None
    CurveKeys.generate()              # a process's own CURVE key pair (never exported)

Derivation is HMAC-SHA256(secret, label) with a versioned label per use, so no derived value
reveals the secret or any other derived value. A principal is `SERVICE`, `OPERATOR` or
`node/<node id>`: a node's token names the node, and the metadata service lets a node act only
as itself, so the router's credential cannot register, publish or deregister as a node, and a
node's cannot act as another node. The ZMQ planes use no derived key: every node and router
makes its own key pair and registers the public half (core.identity). `curve_keys()` derives
one shared pair for the shared-key mode of unit tests and benchmarks only.

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
# The router's client credential (a metadata token of principal SERVICE), so that the router
# never needs the secret: `pdcluster credentials router-token` derives one; the metadata
# service also accepts the one in the file its own $PDCLUSTER_ROUTER_TOKEN_FILE names.
ROUTER_TOKEN_ENV = "PDCLUSTER_ROUTER_TOKEN"
ROUTER_TOKEN_FILE_ENV = "PDCLUSTER_ROUTER_TOKEN_FILE"
MIN_SECRET_BYTES = 32
SERVICE = "service"  # the router, the launcher, operators' tools: read the index, not write it
OPERATOR = "operator"  # release a node id's registration (docs/security.md)
NODE_PREFIX = "node/"
_LABEL_PREFIX = b"pdcluster/v1/"


class CredentialError(ValueError):
    """A secret that cannot be used (missing, malformed, too short)."""


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """A ZMQ CURVE key pair, Z85-encoded (40 bytes each) as libzmq takes them."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print a private key into a log
        return f"CurveKeys(public={self.public!r}, secret=<redacted>)"

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh key pair for this process: the private half never leaves it."""
        import zmq

        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)


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
        """One key pair derived from the secret, for the shared-key mode (unit tests and
        benchmarks: every end serves and connects with it, as principal `MEMBER`). A cluster
        never uses it: each process makes its own (`CurveKeys.generate`)."""
        import zmq  # lazily: only ZMQ users pay for it
        from zmq.utils import z85

        secret_key = z85.encode(self.derive("curve"))
        return CurveKeys(public=zmq.curve_public(secret_key), secret=secret_key)

    def metadata_token(self, principal: str) -> str:
        """The bearer token `principal` presents to the metadata service."""
        check_principal(principal)
        return f"{principal}:{self.derive('metadata/' + principal).hex()}"


def token_from_env(value_env: str, file_env: str,
                   environ: Mapping[str, str] | None = None) -> str | None:
    """A token from `$value_env`, else from the file `$file_env` names (stripped); None when
    neither is set."""
    env = os.environ if environ is None else environ
    if env.get(value_env):
        return env[value_env].strip()
    if env.get(file_env):
        try:
            return Path(env[file_env]).read_text().strip()
        except OSError as exc:
            raise CredentialError(f"cannot read the token file {env[file_env]}: {exc}") from exc
    return None


def write_secret_file(secret: ClusterSecret, path: str | os.PathLike[str]) -> Path:
    """Write the hex form to a new file readable by its owner only (0600; its folder 0700).
    The file is created afresh beside `path` (O_EXCL | O_NOFOLLOW: never through a link or
    into a file someone else opened first) and renamed over it, so a link planted at `path`
    is replaced, not followed."""
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            file.write(secret.to_text() + "\n")
        os.replace(fresh, path)
    except BaseException:
        fresh.unlink(missing_ok=True)
        raise
    return path


def node_principal(node_id: str) -> str:
    return NODE_PREFIX + node_id


def check_principal(principal: str) -> None:
    if principal in (SERVICE, OPERATOR):
        return
    node_id = principal.removeprefix(NODE_PREFIX)
    if node_id == principal or not node_id or ":" in node_id:
        raise CredentialError(f"principal must be {SERVICE!r}, {OPERATOR!r} or 'node/<id>' "
                              f"with no ':', got {principal!r}")


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
