"""API keys and the tenants they belong to: who a request is, and which KV cache it may share.

`PDCLUSTER_API_KEYS` (RouterConfig.api_keys) is a comma-separated list of entries, each
`tenant:key` (keys of one tenant share its cache) or a bare `key` (a tenant of its own,
named by a digest of the key). A key that itself holds ':' must be given with its tenant.

The cache salt a node hashes with is derived here, server-side, from the tenant and the
client's own `cache_salt` (if any): `tenant_salt(tenant, client_salt)`. Two tenants never
share a prefix-cache hit, whatever salts they send, and a client salt still splits a tenant's
cache further. Without API keys (an open router) there are no tenants and the client's salt
is used as sent.

API: `ApiKeys` (`authenticate(request) -> Tenant | None`, raising 401), `tenant_salt`. Shared
by the config (which validates the keys) and the HTTP side, so it needs only a request's
headers, not aiohttp.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from pdcluster.router.errors import ApiError

_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class _Request(Protocol):  # an aiohttp request, as far as a key check looks
    @property
    def headers(self) -> Mapping[str, str]: ...


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str


class ApiKeys:
    def __init__(self, entries: tuple[str, ...]) -> None:
        self._keys: list[tuple[bytes, Tenant]] = [_parse(entry) for entry in entries]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, request: _Request) -> Tenant | None:
        """The tenant of the request's `Authorization: Bearer <key>`; None when the router has
        no keys (open); `ApiError(401)` otherwise. Every key is compared in constant time."""
        if not self._keys:
            return None
        tenant = self.tenant_of(request)
        if tenant is None:
            raise ApiError(401, "invalid or missing API key", None, "invalid_api_key",
                           "authentication_error")
        return tenant

    def tenant_of(self, request: _Request) -> Tenant | None:
        """The request's tenant, or None for a missing or unknown key (no error)."""
        header = request.headers.get("Authorization", "")
        # aiohttp keeps undecodable header bytes as surrogates: give them back as they came
        given = header[7:].encode("utf-8", "surrogateescape") if header.startswith("Bearer ") \
            else b""
        found = None
        for key, tenant in self._keys:  # no early exit: the time says nothing of which key
            if hmac.compare_digest(given, key):
                found = tenant
        return found


def _parse(entry: str) -> tuple[bytes, Tenant]:
    name, sep, key = entry.partition(":")
    if sep and _TENANT.fullmatch(name) and key:
        return key.encode(), Tenant(name)
    if not entry:
        raise ValueError("API keys must be non-empty")
    return entry.encode(), Tenant("key-" + hashlib.sha256(entry.encode()).hexdigest()[:16])


def tenant_salt(tenant: Tenant | None, client_salt: str | None) -> str | None:
    """The cache salt nodes hash a request's blocks with: a digest of its tenant's name and
    the client's own salt, so whatever salt a client sends, its tenant is hashed in and no
    two tenants ever name the same blocks."""
    if tenant is None:
        return client_salt
    digest = hashlib.sha256(f"{tenant.name}\0{client_salt or ''}".encode())
    return "tenant:" + digest.hexdigest()
