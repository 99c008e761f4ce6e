"""The Kubernetes TokenReview API, as the metadata service calls it to learn whose a pod's
projected service-account token is (authentication.k8s.io/v1).

    api = KubernetesAPI(url=in_cluster_url(), token_file=f"{SERVICE_ACCOUNT_DIR}/token",
                        ca_file=f"{SERVICE_ACCOUNT_DIR}/ca.crt")
    reviewer = TokenReviewer(api)
    review = reviewer.review(token, audiences=("pdcluster-metadata",))
    review.authenticated, review.username, review.audiences, review.extra, review.error

The request is `POST /apis/authentication.k8s.io/v1/tokenreviews`, authenticated with the
metadata service's own service-account token (re-read on every call: the kubelet rotates it)
over TLS verified against the cluster's CA. Its service account needs the right to create
TokenReviews (the chart binds it to `system:auth-delegator`). Standard library only: urllib
and ssl.

API: `KubernetesAPI` (where the API server is and how to authenticate to it),
`in_cluster_url`, `SERVICE_ACCOUNT_DIR` (a pod's own token and CA),
`TokenReviewer` (`.review`), `Review`, `TokenReviewUnavailable`.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"
POD_NAME_KEY = "authentication.kubernetes.io/pod-name"
POD_UID_KEY = "authentication.kubernetes.io/pod-uid"
_MAX_REPLY_BYTES = 1 << 20  # a TokenReview's status is a few hundred bytes


class TokenReviewUnavailable(Exception):
    """The API server could not be asked, or did not answer a TokenReview (the token was
    neither accepted nor refused)."""


@dataclass(frozen=True, slots=True)
class KubernetesAPI:
    """The API server's URL (https://host:port), the file holding the bearer token this
    service presents to it, and the CA file that verifies its certificate (None: the
    system's trust store)."""

    url: str
    token_file: str
    ca_file: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("https://", "http://")):
            raise ValueError(f"the Kubernetes API's url must be http(s)://host:port, got "
                             f"{self.url!r}")
        if self.url.startswith("http://") and not _loopback(self.url):
            raise ValueError("the Kubernetes API over plain http only on 127.0.0.1 (a test "
                             f"server): {self.url!r} would carry tokens in the clear")
        if not self.token_file:
            raise ValueError("the Kubernetes API needs a token file (this service's own "
                             "service-account token)")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")



def in_cluster_url(environ: Mapping[str, str] | None = None) -> str:
    """The API server's URL as a pod sees it ($KUBERNETES_SERVICE_HOST/PORT)."""
    env = os.environ if environ is None else environ
    host = env.get("KUBERNETES_SERVICE_HOST")
    if not host:
        raise ValueError("not in a Kubernetes pod ($KUBERNETES_SERVICE_HOST unset): name the "
                         "API server's URL")
    host = f"[{host}]" if ":" in host else host
    return f"https://{host}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"


def _loopback(url: str) -> bool:
    return url.removeprefix("http://").split("/")[0].rsplit(":", 1)[0] in ("127.0.0.1",
                                                                            "[::1]")


@dataclass(frozen=True, slots=True)
class Review:
    """A TokenReview's status: whether the API server authenticated the token, as whom, for
    which of the requested audiences, with what extra attributes (a pod-bound projected token
    carries its pod's name and uid), or why not (`error`)."""

    authenticated: bool
    username: str = ""
    audiences: tuple[str, ...] = ()
    extra: dict[str, tuple[str, ...]] = field(default_factory=dict)
    error: str = ""

    def extra_value(self, key: str) -> str:
        """The single value of `key` in `extra`, or "" when absent or not single."""
        values = self.extra.get(key, ())
        return values[0] if len(values) == 1 else ""


class TokenReviewer:
    """Asks the API server about tokens; one short HTTPS request per review."""

    def __init__(self, api: KubernetesAPI) -> None:
        self.api = api
        self._context = (ssl.create_default_context(cafile=api.ca_file)
                         if api.url.startswith("https://") else None)

    def review(self, token: str, audiences: tuple[str, ...]) -> Review:
        body = json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                           "spec": {"token": token, "audiences": list(audiences)}}).encode()
        request = urllib.request.Request(
            self.api.url.rstrip("/") + REVIEW_PATH, data=body, method="POST",
            headers={"Authorization": f"Bearer {self._own_token()}",
                     "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.api.timeout_s,
                                        context=self._context) as reply:
                data = reply.read(_MAX_REPLY_BYTES)
        except urllib.error.HTTPError as exc:
            raise TokenReviewUnavailable(f"the Kubernetes API refused the TokenReview: HTTP "
                                         f"{exc.code} {exc.reason}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise TokenReviewUnavailable(f"the Kubernetes API at {self.api.url} is "
                                         f"unreachable: {exc}") from exc
        return _parse(data)

    def _own_token(self) -> str:
        try:
            return Path(self.api.token_file).read_text().strip()
        except OSError as exc:
            raise TokenReviewUnavailable(f"cannot read this service's own token "
                                         f"{self.api.token_file}: {exc}") from exc


def _parse(data: bytes) -> Review:
    try:
        status = json.loads(data).get("status") or {}
        user = status.get("user") or {}
        extra = {str(k): tuple(str(v) for v in values)
                 for k, values in (user.get("extra") or {}).items()}
        return Review(authenticated=status.get("authenticated") is True,
                      username=str(user.get("username", "")),
                      audiences=tuple(str(a) for a in status.get("audiences") or ()),
                      extra=extra, error=str(status.get("error", "")))
    except (ValueError, AttributeError, TypeError) as exc:
        raise TokenReviewUnavailable(f"the Kubernetes API's TokenReview reply is not one: "
                                     f"{exc}") from exc
