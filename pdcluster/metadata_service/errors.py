"""Typed exceptions at the metadata service's boundaries.

Server side, ``InvalidBatch`` carries a short ``reason`` (counted in stats) and a precise
message (sent to the caller as INVALID_ARGUMENT). Client side, gRPC status codes become
``MetadataUnavailable`` (cannot reach the service), ``MetadataAuthError`` (token or TLS
refused, or the token's principal may not do this) and ``MetadataRequestError`` (the
service rejected the request).
"""

from __future__ import annotations


class MetadataError(Exception):
    """Base of every metadata-service error. A client-side one names the gRPC status
    (`status`, e.g. "UNAVAILABLE") and the service's `details`; both empty otherwise."""

    def __init__(self, message: str, status: str = "", details: str = "") -> None:
        super().__init__(message)
        self.status, self.details = status, details


class MetadataUnavailable(MetadataError):
    """The service could not be reached (down, network, deadline exceeded)."""


class MetadataAuthError(MetadataError):
    """The service refused the call's credentials (missing or wrong token: UNAUTHENTICATED)
    or its principal may not do this (another node's id: PERMISSION_DENIED)."""


class MetadataRequestError(MetadataError):
    """The service rejected the request itself (malformed, oversize, unknown node)."""


class InvalidBatch(MetadataError, ValueError):
    """A malformed or oversize request; ``reason`` is a stable label for stats."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
