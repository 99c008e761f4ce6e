"""The metadata service's authentication: the principal a call's bearer token proves, and
the interceptor that refuses every call, streams included, without one.

API: `Verifier(secret, router_token)` (`.principal(metadata)`), `AuthInterceptor(verifier)`.
"""

from __future__ import annotations

import hmac
from typing import Any

import grpc

from pdcluster.core.credentials import SERVICE, ClusterSecret, verify_metadata_token
from pdcluster.metadata_service.wire import AUTH_HEADER


class Verifier:
    """Which principal a call's ``authorization: Bearer <token>`` proves: a token derived
    from the cluster secret for that principal, or the configured router token (principal
    ``service``). Constant-time compares."""

    def __init__(self, secret: ClusterSecret, router_token: str | None = None) -> None:
        self._secret = secret
        self._router_token = router_token.encode() if router_token else None

    def principal(self, metadata: Any) -> str | None:
        for key, value in metadata or ():
            if key == AUTH_HEADER:
                scheme, _, token = str(value).partition(" ")
                return self._verify(token) if scheme == "Bearer" else None
        return None

    def _verify(self, token: str) -> str | None:
        if self._router_token is not None and hmac.compare_digest(token.encode(),
                                                                  self._router_token):
            return SERVICE
        return verify_metadata_token(self._secret, token)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call, streams included, that lacks a valid token (`Verifier`)."""

    def __init__(self, verifier: Verifier) -> None:
        self._verifier = verifier

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self._verifier.principal(handler_call_details.invocation_metadata):
            return handler
        return _denying_handler(handler)


async def _deny(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or invalid token: send 'authorization: Bearer <token>' with "
                        "a token derived from the cluster secret")


def _denying_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_deny, **kwargs)
    return grpc.unary_unary_rpc_method_handler(_deny, **kwargs)
