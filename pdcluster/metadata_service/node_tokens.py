"""Node tokens issued by the metadata service against a pod's identity, so that no Ray pod
holds the cluster secret: a node actor presents its pod's projected service-account token
(audience `PodIdentityConfig.audience`, short-lived, rotated by the kubelet), the service asks
Kubernetes whose it is (TokenReview) and, if it is a pod of the release's Ray service account
and the node id is one the service admits for that role, answers with a `node/<id>` token
bound to that pod (its uid is in the token) that expires with the pod's token, at most
`token_ttl_s` after issue. The node renews it before then with its pod's current projected
token; once the pod is gone the API server refuses its token, so its node tokens die within
`token_ttl_s`.

    issuer = NodeTokenIssuer(config, secret, TokenReviewer(identity.api))
    issued = issuer.exchange(service_account_token, node_id, "prefill")  # or ExchangeRefused
    verify_pod_token(secret, issued.token, now) -> "node/<id>" | None

A pod token is `node/<id>:pod1.<pod uid>.<expiry, unix s>.<HMAC-SHA256 hex>`, the MAC keyed by
a value derived from the cluster secret over the id, the pod's uid and the expiry.

API: `PodIdentityConfig`, `NodeTokenIssuer`, `IssuedToken`, `ExchangeRefused`,
`issue_pod_token`, `verify_pod_token`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.core.credentials import ClusterSecret, CredentialError, check_principal
from pdcluster.metadata_service.tokenreview import (
    POD_NAME_KEY,
    POD_UID_KEY,
    KubernetesAPI,
    TokenReviewer,
    TokenReviewUnavailable,
)

_POD_TOKEN = re.compile(r"pod1\.([0-9a-zA-Z-]{1,64})\.([0-9]{1,12})\.([0-9a-f]{64})")
_MAX_SA_TOKEN_CHARS = 16384  # a projected token is ~1 KB; the review is not asked for more
ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class PodIdentityConfig:
    """How the service checks pods: the audience their projected tokens must name, the one
    service account (namespace, name) whose pods may have node tokens, the API server that
    reviews tokens, and the longest a node token lives."""

    audience: str
    namespace: str
    service_account: str
    api: KubernetesAPI
    token_ttl_s: int = 600
    max_concurrent_reviews: int = 4  # beyond: refused, so strangers cannot flood the API

    def __post_init__(self) -> None:
        for name in ("audience", "namespace", "service_account"):
            if not getattr(self, name):
                raise ValueError(f"pod identity needs {name}")
        if self.audience.startswith("https://kubernetes.default"):
            raise ValueError("the audience must be pdcluster's own, not the API server's: "
                             "a token for the API server would be accepted by both")
        if not 60 <= self.token_ttl_s <= 86400:
            raise ValueError(f"token_ttl_s must be in [60, 86400], got {self.token_ttl_s}")
        if self.max_concurrent_reviews < 1:
            raise ValueError("max_concurrent_reviews must be >= 1")

    @property
    def username(self) -> str:
        """The name TokenReview gives a token of the service account's pods."""
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


class ExchangeRefused(Exception):
    """A refused exchange; `kind` is "unauthenticated" (the pod's token proves nothing for
    this audience), "permission" (it proves a pod that may not have this token), "invalid"
    (a malformed request) or "unavailable" (Kubernetes could not be asked)."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class IssuedToken:
    token: str
    expires_at: int
    pod_name: str
    pod_uid: str


def _mac(secret: ClusterSecret, node_id: str, pod_uid: str, expires_at: int) -> str:
    key = secret.derive("metadata-pod-token")
    label = f"node/{node_id}\0{pod_uid}\0{expires_at}".encode()
    return hmac.new(key, label, hashlib.sha256).hexdigest()


def issue_pod_token(secret: ClusterSecret, node_id: str, pod_uid: str, expires_at: int) -> str:
    mac = _mac(secret, node_id, pod_uid, expires_at)
    return f"node/{node_id}:pod1.{pod_uid}.{expires_at}.{mac}"


def verify_pod_token(secret: ClusterSecret, token: str, now: float) -> str | None:
    """The principal a pod token proves until its expiry, or None (constant-time compare)."""
    principal, _, rest = token.rpartition(":")
    match = _POD_TOKEN.fullmatch(rest)
    if match is None or not principal.startswith("node/"):
        return None
    pod_uid, expires_at, mac = match.group(1), int(match.group(2)), match.group(3)
    expected = _mac(secret, principal.removeprefix("node/"), pod_uid, expires_at)
    if not hmac.compare_digest(expected, mac) or now >= expires_at:
        return None
    return principal


def _jwt_expiry(token: str) -> int | None:
    """The `exp` claim of an already-authenticated JWT (its signature was the API server's
    to check), or None when it carries none."""
    try:
        payload = token.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        exp = claims.get("exp")
    except (IndexError, ValueError, AttributeError):
        return None
    return int(exp) if isinstance(exp, int | float) else None


class NodeTokenIssuer:
    """Checks a pod's token (TokenReview) and the node id it asks for, and issues the pod a
    token of that node. `admits(role, node_id)` is the service's allowlist (or, without one,
    whether the role has a count bound)."""

    def __init__(self, identity: PodIdentityConfig, secret: ClusterSecret,
                 admits: Callable[[str, str], str | None],
                 reviewer: TokenReviewer | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.identity = identity
        self._secret = secret
        self._admits = admits
        self._reviewer = reviewer or TokenReviewer(identity.api)
        self._clock = clock

    def exchange(self, sa_token: str, node_id: str, role: str) -> IssuedToken:
        self._check_request(sa_token, node_id, role)
        try:
            review = self._reviewer.review(sa_token, (self.identity.audience,))
        except TokenReviewUnavailable as exc:
            raise ExchangeRefused("unavailable", str(exc)) from exc
        if not review.authenticated:
            raise ExchangeRefused("unauthenticated", "Kubernetes did not authenticate the "
                                  f"service-account token: {review.error or 'no reason given'}")
        if self.identity.audience not in review.audiences:
            raise ExchangeRefused("unauthenticated", "the service-account token is not for "
                                  f"audience {self.identity.audience!r} (Kubernetes names "
                                  f"{list(review.audiences)})")
        if review.username != self.identity.username:
            raise ExchangeRefused("permission", f"{review.username!r} may not have node tokens: "
                                  f"only pods of {self.identity.username!r} may")
        pod_uid, pod_name = review.extra_value(POD_UID_KEY), review.extra_value(POD_NAME_KEY)
        if not re.fullmatch(r"[0-9a-zA-Z-]{1,64}", pod_uid):
            raise ExchangeRefused("permission", "the service-account token is not bound to a "
                                  "pod (no pod uid in its TokenReview): use a projected token")
        # only now, to a caller Kubernetes vouched for, does a refusal say which ids exist
        refusal = self._admits(role, node_id)
        if refusal is not None:
            raise ExchangeRefused("permission", refusal)
        return self._issue(sa_token, node_id, pod_uid, pod_name)

    def _check_request(self, sa_token: str, node_id: str, role: str) -> None:
        if role not in ROLES:
            raise ExchangeRefused("invalid", f"role must be one of {ROLES}, got {role!r}")
        try:
            check_principal(f"node/{node_id}")
        except CredentialError as exc:
            raise ExchangeRefused("invalid", str(exc)) from exc
        if not sa_token:
            raise ExchangeRefused("unauthenticated", "no service-account token")
        if len(sa_token) > _MAX_SA_TOKEN_CHARS:
            raise ExchangeRefused("unauthenticated", "the service-account token is longer "
                                  f"than {_MAX_SA_TOKEN_CHARS} characters")

    def _issue(self, sa_token: str, node_id: str, pod_uid: str, pod_name: str) -> IssuedToken:
        now = int(self._clock())
        expires_at = now + self.identity.token_ttl_s
        pod_expiry = _jwt_expiry(sa_token)
        if pod_expiry is not None:
            if pod_expiry <= now:
                raise ExchangeRefused("unauthenticated", "the service-account token expired")
            expires_at = min(expires_at, pod_expiry)
        token = issue_pod_token(self._secret, node_id, pod_uid, expires_at)
        return IssuedToken(token=token, expires_at=expires_at, pod_name=pod_name,
                           pod_uid=pod_uid)
