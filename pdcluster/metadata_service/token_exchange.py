"""The `ExchangeNodeToken` RPC: a pod's projected service-account token for its node's token
(node_tokens.py checks and issues). It is the one call the interceptor lets through without a
bearer token (the service-account token is the credential); under mTLS with role binding, the
connection's certificate must still be a node's. Reviews run off the event loop (a blocking
HTTPS call to the API server), at most `max_concurrent_reviews` at once: past that a call is
refused at once, so a flood of made-up tokens cannot queue up requests to Kubernetes.

API: `EXCHANGE_METHOD`, `TokenExchange` (`.handle(request, context)`).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdcluster.core.credentials import node_principal
from pdcluster.metadata_service.cert_roles import may_present, peer_role, refusal
from pdcluster.metadata_service.node_tokens import ExchangeRefused, NodeTokenIssuer
from pdcluster.proto import metadata_pb2 as pb

logger = logging.getLogger(__name__)
EXCHANGE_METHOD = "/pdcluster.metadata.v1.MetadataService/ExchangeNodeToken"
_ROLE_NAMES = {pb.PREFILL: "prefill", pb.DECODE: "decode"}
_CODES = {"unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
          "permission": grpc.StatusCode.PERMISSION_DENIED,
          "invalid": grpc.StatusCode.INVALID_ARGUMENT,
          "unavailable": grpc.StatusCode.UNAVAILABLE}


class TokenExchange:
    """Serves ExchangeNodeToken; `issuer` None: this service issues no node tokens."""

    def __init__(self, issuer: NodeTokenIssuer | None, bind_roles: bool) -> None:
        self._issuer = issuer
        self._bind_roles = bind_roles
        self._slots = (asyncio.Semaphore(issuer.identity.max_concurrent_reviews)
                       if issuer is not None else None)

    async def handle(self, request: pb.NodeTokenRequest,
                     context: grpc.aio.ServicerContext) -> pb.NodeTokenReply:
        if self._issuer is None or self._slots is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this metadata service issues no node tokens (start it with "
                                "--pod-identity-audience and its Kubernetes settings)")
            raise AssertionError("abort returned")
        if self._bind_roles:
            role, common_name = peer_role(context)
            principal = node_principal(request.node_id or "-")
            if not may_present(role, principal):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    refusal(common_name, role, principal))
        if self._slots.locked():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "too many token reviews in flight: retry shortly")
        async with self._slots:
            try:
                issued = await asyncio.to_thread(
                    self._issuer.exchange, request.service_account_token, request.node_id,
                    _ROLE_NAMES.get(request.role, f"role {request.role}"))
            except ExchangeRefused as exc:
                logger.warning("node token for %r refused: %s", request.node_id[:64], exc)
                await context.abort(_CODES[exc.kind], f"node token refused: {exc}")
                raise AssertionError("abort returned") from exc
        logger.info("issued a token of node %s to pod %s (uid %s), expiring at %d",
                    request.node_id, issued.pod_name, issued.pod_uid, issued.expires_at)
        return pb.NodeTokenReply(token=issued.token, expires_at_unix=issued.expires_at,
                                 pod_name=issued.pod_name)
