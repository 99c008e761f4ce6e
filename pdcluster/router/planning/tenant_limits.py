"""Per-tenant limits on what a tenant has in flight at the router: requests, and tokens
(each request's prompt plus its max_tokens, the most it can hold on the nodes). A request over
its tenant's limit is refused at once with 429 and Retry-After; other tenants' requests are
counted apart and never wait on it. A single request larger than its tenant's token limit is
a 400 (retrying cannot help).

A tenant is an API key's tenant (router.tenants); without API keys every request counts
against one shared tenant "" (the limits then cap the router as a whole). Limits come from
the tenant's own entry, else the defaults; None means no limit.

Config: `router serve --tenant-max-requests N --tenant-max-tokens N --tenant-limit
NAME:REQUESTS:TOKENS` or cluster.yaml's `router.tenant_limits` (`from_dict`).

API: `TenantLimits`, `TenantLimiter` (`acquire(tenant) -> Lease`), `Lease` (`take_tokens(n)`,
`release()`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdcluster.router.errors import ApiError

_KEYS = {"max_requests", "max_tokens", "tenants", "retry_after_s"}
_TENANT_KEYS = {"max_requests", "max_tokens"}


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_requests: int | None = None  # each tenant's in-flight requests, by default
    max_tokens: int | None = None  # each tenant's in-flight prompt + max_tokens, by default
    # (tenant name, max_requests, max_tokens): a tenant's own limits (None: no limit)
    tenants: tuple[tuple[str, int | None, int | None], ...] = field(default=())
    retry_after_s: int = 1  # the Retry-After of a 429

    def __post_init__(self) -> None:
        values = [self.max_requests, self.max_tokens,
                  *(v for _, r, t in self.tenants for v in (r, t))]
        if any(v is not None and v < 1 for v in values):
            raise ValueError("tenant limits must be >= 1 (or unset: no limit)")
        names = [name for name, _, _ in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant_limits names a tenant twice")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")

    def of(self, tenant: str) -> tuple[int | None, int | None]:
        """(max_requests, max_tokens) of `tenant`."""
        for name, requests, tokens in self.tenants:
            if name == tenant:
                return requests, tokens
        return self.max_requests, self.max_tokens

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TenantLimits:
        """cluster.yaml's `router.tenant_limits`: {max_requests, max_tokens, retry_after_s,
        tenants: {NAME: {max_requests, max_tokens}}}; an unknown key is refused by name."""
        unknown = set(data) - _KEYS
        if unknown:
            raise ValueError(f"unknown tenant_limits keys: {sorted(unknown)}")
        tenants = []
        for name, limits in (data.get("tenants") or {}).items():
            unknown = set(limits or {}) - _TENANT_KEYS
            if unknown:
                raise ValueError(f"unknown tenant_limits.tenants.{name} keys: {sorted(unknown)}")
            tenants.append((str(name), (limits or {}).get("max_requests"),
                            (limits or {}).get("max_tokens")))
        return cls(data.get("max_requests"), data.get("max_tokens"), tuple(tenants),
                   data.get("retry_after_s", 1))

    @staticmethod
    def parse_tenant(entry: str) -> tuple[str, int | None, int | None]:
        """`NAME:REQUESTS:TOKENS` (an empty number: no limit) as a `tenants` entry."""
        parts = entry.split(":")
        if len(parts) != 3 or not parts[0]:
            raise ValueError(f"a tenant limit is NAME:REQUESTS:TOKENS, got {entry!r}")
        try:
            numbers = [int(p) if p else None for p in parts[1:]]
        except ValueError:
            raise ValueError(f"a tenant limit is NAME:REQUESTS:TOKENS, got {entry!r}") from None
        return parts[0], numbers[0], numbers[1]


class Lease:
    """One admitted request's share of its tenant's limits, until `release()`."""

    __slots__ = ("_limiter", "_tenant", "tokens")

    def __init__(self, limiter: TenantLimiter, tenant: str) -> None:
        self._limiter: TenantLimiter | None = limiter
        self._tenant, self.tokens = tenant, 0

    def take_tokens(self, tokens: int) -> None:
        """Count the request's tokens (prompt + max_tokens of every sample), known once it
        is tokenized, or raise as `TenantLimiter.acquire` does."""
        assert self._limiter is not None, "a released lease takes no tokens"
        self._limiter._take_tokens(self._tenant, tokens)
        self.tokens += tokens

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter._release(self._tenant, self.tokens)
            self._limiter = None


class TenantLimiter:
    """In-flight requests and tokens per tenant (one event loop: no locking). A request is
    counted from before its body is parsed (so a tenant's bodies cannot hold every thread
    that tokenizes), its tokens once it is tokenized."""

    def __init__(self, limits: TenantLimits,
                 on_limited: Callable[[], object] | None = None) -> None:
        self.limits = limits
        self._on_limited = on_limited
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def acquire(self, tenant: str) -> Lease:
        """Count a request against `tenant`, or raise a 429 `ApiError`."""
        max_requests, _ = self.limits.of(tenant)
        held = self._requests.get(tenant, 0)
        if max_requests is not None and held >= max_requests:
            raise self._limited(f"{max_requests} requests")
        self._requests[tenant] = held + 1
        self._tokens.setdefault(tenant, 0)
        return Lease(self, tenant)

    def in_flight(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) `tenant` has in flight."""
        return self._requests.get(tenant, 0), self._tokens.get(tenant, 0)

    def _take_tokens(self, tenant: str, tokens: int) -> None:
        _, max_tokens = self.limits.of(tenant)
        if max_tokens is not None and tokens > max_tokens:
            raise ApiError(400, f"the request's prompt and max_tokens ({tokens} tokens) are "
                           f"over this API key's limit of {max_tokens} tokens in flight",
                           "max_tokens", "tenant_token_limit")
        in_flight = self._tokens[tenant]
        if max_tokens is not None and in_flight + tokens > max_tokens:
            raise self._limited(f"{max_tokens} tokens (prompt + max_tokens)")
        self._tokens[tenant] = in_flight + tokens

    def _release(self, tenant: str, tokens: int) -> None:
        left = self._requests[tenant] - 1
        if left:
            self._requests[tenant] = left
            self._tokens[tenant] -= tokens
        else:  # no entry kept for an idle tenant
            del self._requests[tenant], self._tokens[tenant]

    def _limited(self, what: str) -> ApiError:
        if self._on_limited is not None:
            self._on_limited()
        retry = self.limits.retry_after_s
        return ApiError(429, f"this API key has its limit of {what} in flight; retry after "
                        f"{retry} s", None, "tenant_limit_exceeded", "rate_limit_error",
                        retry_after_s=retry)
