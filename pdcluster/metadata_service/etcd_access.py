"""How the metadata service reaches etcd: client TLS and etcd's own auth, and the one-time setup
of the user and role that confine it to pdcluster's key prefix.

TLS (``MetadataConfig.etcd_tls``, a ``core.tls.ClientTLS``): the CA that signed etcd's server
certificate, and the client certificate etcd asks for when it runs ``--client-cert-auth``.
Auth (``etcd_user``/``etcd_password``): the store authenticates at start and again every
``etcd_reauth_interval_s`` and after every outage (etcd's simple tokens expire and do not
survive an etcd restart). A refused password is ``EtcdAccessError`` at start — the service
exits with that message rather than serving from memory while it retries a password that will
never work.

``setup_prefix_role`` is what ``pdcluster metadata etcd-setup`` runs, as etcd's root: a role
granted readwrite on ``<prefix>/`` and nothing else, a user holding only that role, and auth
switched on (with the root user etcd requires first). It is idempotent: an existing role,
user or root is kept (the user's password is set again), so rerunning it is safe.

API: ``EtcdAccessError``, ``EtcdAuthDisabled``, ``make_client``, ``grpc_target``,
``authenticate``, ``setup_prefix_role``, ``prefix_range``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Sequence

import etcd3aio
import grpc
from etcd3aio.auth import PermissionType

from pdcluster.core.tls import ClientTLS

ROOT = "root"  # etcd's superuser: its role "root" may do anything, auth enable needs it


class EtcdAccessError(Exception):
    """etcd refused the configured credentials (user/password, or the setup's root), or its
    endpoints cannot be resolved."""


class EtcdAuthDisabled(EtcdAccessError):
    """A user was configured, but etcd's auth is off (anyone may do anything there)."""


def make_client(endpoints: Sequence[str], tls: ClientTLS | None,
                **options: object) -> etcd3aio.Etcd3Client:
    """An unconnected client for ``endpoints`` over TLS when ``tls`` is given (its files are
    read now: a bad path is a ``TLSFileError`` at start). Endpoints may be DNS names."""
    conn: dict[str, bytes | None] = {}
    server_name = None
    target, host_name = grpc_target(endpoints)
    if tls is not None:
        conn["ca_cert"], conn["cert_chain"], conn["cert_key"] = tls.read_pem()
        # several resolved names: no single authority, so check the first name's certificate
        server_name = tls.server_name or (host_name if len(endpoints) > 1 else None)
    client = etcd3aio.Etcd3Client(list(endpoints), tls_server_name=server_name,
                                  **options, **conn)  # type: ignore[arg-type]
    # Private hook: etcd3aio dials "ipv4:<endpoints>", which only takes IP addresses (and
    # rewrites "localhost" inside any name); a Kubernetes Service name must go through DNS.
    client._manager.target = target
    return client


def grpc_target(endpoints: Sequence[str]) -> tuple[str, str | None]:
    """(gRPC target, the first DNS name or None) for ``host:port`` endpoints: IP addresses as
    ``ipv4:``/``ipv6:`` lists; one DNS name as ``dns:///`` (re-resolved on reconnect: an etcd
    Service); several with DNS names resolved once, now, into an address list."""
    hosts = [_split(e) for e in endpoints]
    names = [h for h, _ in hosts if not _is_ip(h)]
    if len(endpoints) == 1 and names:
        return f"dns:///{endpoints[0]}", names[0]
    v4: list[str] = []
    v6: list[str] = []
    for host, port in hosts:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise EtcdAccessError(f"cannot resolve etcd endpoint {host}:{port}: {exc}") from exc
        for info in infos:
            address = str(info[4][0])
            if ":" in address:
                v6.append(f"[{address}]:{port}")
            else:
                v4.append(f"{address}:{port}")
    first_name = names[0] if names else None
    if v4:  # one gRPC target cannot mix the two families
        return "ipv4:" + ",".join(dict.fromkeys(v4)), first_name
    return "ipv6:" + ",".join(dict.fromkeys(v6)), first_name


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an etcd endpoint is host:port, got {endpoint!r}")
    return host.strip("[]"), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def authenticate(client: etcd3aio.Etcd3Client, user: str, password: str,
                       timeout_s: float) -> None:
    """Log ``user`` in and send its token on every later call of ``client``. A refusal is
    ``EtcdAccessError``; an unreachable etcd stays an ``etcd3aio.EtcdError`` (retried)."""
    assert client.auth is not None, "connect() the client first"
    client.set_token(None)  # etcd refuses even Authenticate with a stale token attached
    try:
        reply = await client.auth.authenticate(user, password, timeout=timeout_s)
    except (etcd3aio.EtcdError, grpc.aio.AioRpcError) as exc:
        # etcd answers a wrong password with INVALID_ARGUMENT, which etcd3aio passes through
        if "not enabled" in _message(exc):
            raise EtcdAuthDisabled(
                f"etcd has auth disabled, but user {user!r} was configured: run `pdcluster "
                "metadata etcd-setup` (docs/security.md)") from exc
        if isinstance(exc, (etcd3aio.EtcdConnectionError, etcd3aio.EtcdTransientError)):
            raise
        raise EtcdAccessError(f"etcd refused user {user!r}: {_message(exc)}") from exc
    client.set_token(reply.token)


def _message(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.details() or exc.code().name
    return str(exc)


def prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """[key, range_end) of everything the store writes under ``prefix`` (``<prefix>/...``)."""
    root = f"{prefix}/".encode()
    return root, etcd3aio.prefix_range_end(root)


async def setup_prefix_role(endpoints: Sequence[str], tls: ClientTLS | None, prefix: str,
                            user: str, password: str, root_password: str,
                            timeout_s: float = 10.0) -> list[str]:
    """Create (or refresh) role ``user`` with readwrite on ``<prefix>/`` only, user ``user``
    holding that role, and turn auth on; return what was done, one line per step."""
    client = make_client(endpoints, tls, rpc_max_attempts=1)
    await client.connect()
    try:
        return await asyncio.wait_for(
            _setup(client, prefix, user, password, root_password, timeout_s), timeout_s * 4)
    finally:
        await client.close()


async def _setup(client: etcd3aio.Etcd3Client, prefix: str, user: str, password: str,
                 root_password: str, timeout_s: float) -> list[str]:
    auth = client.auth
    assert auth is not None, "connected"
    done: list[str] = []
    # etcd 3.4 has no AuthStatus: whether root may log in tells whether auth is on
    try:
        await authenticate(client, ROOT, root_password, timeout_s)
        enabled = True
        done.append("auth already enabled: logged in as root")
    except EtcdAuthDisabled:
        enabled = False
    if not enabled:
        if await _add_user(client, ROOT, root_password, timeout_s):
            done.append("added user root")
        await auth.user_grant_role(ROOT, ROOT, timeout=timeout_s)
    with contextlib.suppress(etcd3aio.EtcdError, grpc.aio.AioRpcError):  # it exists already
        await auth.role_add(user, timeout=timeout_s)
    key, range_end = prefix_range(prefix)
    await auth.role_grant_permission(user, key, range_end=range_end,
                                     perm_type=PermissionType.READWRITE, timeout=timeout_s)
    done.append(f"role {user}: readwrite on prefix {key.decode()}")
    if not await _add_user(client, user, password, timeout_s):
        await auth.user_change_password(user, password, timeout=timeout_s)
    await auth.user_grant_role(user, user, timeout=timeout_s)
    done.append(f"user {user}: role {user} only")
    if not enabled:
        await auth.auth_enable(timeout=timeout_s)
        done.append("auth enabled")
    return done


async def _add_user(client: etcd3aio.Etcd3Client, name: str, password: str,
                    timeout_s: float) -> bool:
    """Add ``name``; False when it exists already."""
    assert client.auth is not None, "connected"
    try:
        await client.auth.user_add(name, password, timeout=timeout_s)
    except (etcd3aio.EtcdError, grpc.aio.AioRpcError) as exc:
        if "already exists" in _message(exc):
            return False
        raise
    return True
