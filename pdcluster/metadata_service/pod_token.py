"""A node's metadata token on Kubernetes, obtained from the metadata service against its pod's
projected service-account token (node_tokens.py says what the service checks), and renewed
before it expires: the node's clients call the source for the current token on every call.

    source = PodTokenSource(address, "p0", "prefill", "/var/run/secrets/pdcluster-node/token",
                            tls=ClientTLS(...))
    MetadataClient(address, token=source, tls=...)

The projected token file is read anew at each exchange (the kubelet rotates it before it
expires). A token is renewed once two thirds of its life are gone; a failed renewal keeps the
current token while it is valid and is retried every `retry_s`. The first exchange, or one
after the token expired, raises what the exchange raised (a `MetadataError`).

API: `PodTokenSource`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pdcluster.core.tls import ClientTLS
from pdcluster.metadata_service.client import MetadataClient
from pdcluster.metadata_service.errors import MetadataAuthError, MetadataError

logger = logging.getLogger(__name__)
_RENEW_AT_FRACTION = 2 / 3


class PodTokenSource:
    def __init__(self, address: str, node_id: str, role: str, token_file: str,
                 tls: ClientTLS | None = None, timeout_s: float = 10.0, retry_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.address, self.node_id, self.role = address, node_id, role
        self.token_file = token_file
        self._tls, self._timeout_s, self._retry_s, self._clock = tls, timeout_s, retry_s, clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expires_at = 0.0
        self._renew_at = 0.0
        self.num_exchanges = 0

    def __repr__(self) -> str:  # never print the token into a log
        return f"PodTokenSource(node_id={self.node_id!r}, expires_at={self._expires_at})"

    def __call__(self) -> str:
        with self._lock:
            now = self._clock()
            if self._token is None or now >= self._renew_at:
                self._renew(now)
            assert self._token is not None, "a renewal sets the token or raises"
            return self._token

    def _renew(self, now: float) -> None:
        try:
            token, expires_at = self._exchange()
        except MetadataError as exc:
            if self._token is None or now >= self._expires_at:
                raise
            logger.error("node %s: renewing its metadata token failed (the current one lasts "
                         "%.0f s more): %s", self.node_id, self._expires_at - now, exc)
            self._renew_at = now + self._retry_s
            return
        self._token, self._expires_at = token, float(expires_at)
        self._renew_at = now + max(1.0, (expires_at - now) * _RENEW_AT_FRACTION)
        self.num_exchanges += 1

    def _exchange(self) -> tuple[str, int]:
        try:
            pod_token = Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise MetadataAuthError(f"node {self.node_id}: cannot read its pod's projected "
                                    f"service-account token {self.token_file}: {exc}") from exc
        with MetadataClient(self.address, tls=self._tls, timeout_s=self._timeout_s) as client:
            reply = client.exchange_node_token(pod_token, self.node_id, self.role)
        return reply.token, reply.expires_at_unix
