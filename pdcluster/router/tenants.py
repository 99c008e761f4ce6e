"""API keys and the tenants they belong to: who a request is, and which KV cache it may share.

`PDCLUSTER_API_KEYS` (RouterConfig.api_keys) is a comma-separated list of entries, each
`tenant:key` (keys of one tenant share its cache) or a bare `key` (a tenant of its own,
named by a digest of the key). A key that itself holds ':' must be given with its tenant.

The cache salt a node hashes with is derived here, server-side, from the tenant and the
client's own `cache_salt` (if any), keyed with the router's cache-salt key:
`tenant_salt(tenant, client_salt, key)` is HMAC-SHA256(key, tenant \0 client salt). Two
tenants never share a prefix-cache hit, whatever salts they send, a client salt still splits
a tenant's cache further, and without the key nobody computes a tenant's salt from its name
(so no member can name, or ask a holder about, a tenant's blocks). Every router replica of a
cluster must hold the same key, or they share no prefixes: `RouterConfig.cache_salt_key`
($PDCLUSTER_CACHE_SALT_KEY[_FILE]; the chart generates it, `pdcluster serve` derives it from
the cluster secret, `pdcluster router serve` refuses to start with API keys but no key).
`TenantSalts(None)` makes a key for this process alone, with a warning (one router whose
restarts start with a cold cache). Without API keys (an open router) there are no tenants
and the client's salt is used as sent.

API: `ApiKeys` (`authenticate(request) -> Tenant | None`, raising 401), `TenantSalts`,
`tenant_salt`, `SALT_KEY_ENV`, `SALT_KEY_FILE_ENV`. Shared
by the config (which validates the keys) and the HTTP side, so it needs only a request's
headers, not aiohttp.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from pdcluster.router.errors import ApiError

logger = logging.getLogger(__name__)

_TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SALT_KEY_ENV = "PDCLUSTER_CACHE_SALT_KEY"
SALT_KEY_FILE_ENV = "PDCLUSTER_CACHE_SALT_KEY_FILE"
MIN_SALT_KEY_BYTES = 16


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


def tenant_salt(tenant: Tenant | None, client_salt: str | None, key: bytes) -> str | None:
    """The cache salt nodes hash a request's blocks with: an HMAC, under the router's
    cache-salt key, of its tenant's name and the client's own salt, so whatever salt a client
    sends, its tenant is hashed in, no two tenants ever name the same blocks, and nobody
    without the key can compute the salt from a tenant's name."""
    if tenant is None:
        return client_salt
    digest = hmac.new(key, f"{tenant.name}\0{client_salt or ''}".encode(), hashlib.sha256)
    return "tenant:" + digest.hexdigest()


class TenantSalts:
    """A router's tenant salts under its cache-salt key (None: a key of this process's own,
    with a warning: other routers and this one after a restart salt differently)."""

    def __init__(self, key: bytes | None) -> None:
        if key is None:
            logger.warning("no cache-salt key ($%s[_FILE]): this router salts tenants' caches "
                           "with a key of its own process, so other router replicas, and this "
                           "one after a restart, share none of their prefixes", SALT_KEY_ENV)
            key = secrets.token_bytes(32)
        self._key = key

    def salt(self, tenant: Tenant | None, client_salt: str | None) -> str | None:
        return tenant_salt(tenant, client_salt, self._key)
