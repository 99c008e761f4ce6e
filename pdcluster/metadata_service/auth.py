"""The metadata service's authentication: the principal a call's bearer token proves, and
the interceptor that refuses every call, streams included, without one — and, with
``bind_roles``, every call whose token's principal the connection's client certificate may not
present (cert_roles.py: a router's token over a node's certificate, and the reverse).

The token exchange (`ExchangeNodeToken`) is let through without one: it checks its own
credential, a pod's service-account token.

API: `Verifier(secret, router_token, pod_tokens)` (`.principal(metadata)`),
`AuthInterceptor(verifier, bind_roles=False)`.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from typing import Any

import grpc

from pdcluster.core.credentials import SERVICE, ClusterSecret, verify_metadata_token
from pdcluster.metadata_service.cert_roles import may_present, peer_role, refusal
from pdcluster.metadata_service.node_tokens import verify_pod_token
from pdcluster.metadata_service.token_exchange import EXCHANGE_METHOD
from pdcluster.metadata_service.wire import AUTH_HEADER


class Verifier:
    """Which principal a call's ``authorization: Bearer <token>`` proves: a token derived
    from the cluster secret for that principal, or the configured router token (principal
    ``service``), or, with `pod_tokens`, a node token issued to a pod and not yet expired
    (node_tokens.py). Constant-time compares."""

    def __init__(self, secret: ClusterSecret, router_token: str | None = None,
                 pod_tokens: bool = False, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self._router_token = router_token.encode() if router_token else None
        self._pod_tokens = pod_tokens
        self._clock = clock

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
        if self._pod_tokens and ":pod1." in token:
            return verify_pod_token(self._secret, token, self._clock())
        return verify_metadata_token(self._secret, token)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call, streams included, that lacks a valid token (`Verifier`), but the
    token exchange (token_exchange.py: a pod's service-account token is its credential); with
    `bind_roles`, also one whose principal its client certificate's role may not present
    (the certificate is only visible to the handler's context, so the check wraps it)."""

    def __init__(self, verifier: Verifier, bind_roles: bool = False) -> None:
        self._verifier = verifier
        self._bind_roles = bind_roles

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method == EXCHANGE_METHOD:
            return handler
        principal = self._verifier.principal(handler_call_details.invocation_metadata)
        if not principal:
            return _denying_handler(handler)
        return _role_bound_handler(handler, principal) if self._bind_roles else handler


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


async def _check_role(context: grpc.aio.ServicerContext, principal: str) -> None:
    role, common_name = peer_role(context)
    if not may_present(role, principal):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                            refusal(common_name, role, principal))


def _role_bound_handler(handler: grpc.RpcMethodHandler,
                        principal: str) -> grpc.RpcMethodHandler:
    """`handler`, run only once the connection's certificate may present `principal`
    (every method of the service takes one request message)."""
    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        stream: Any = handler.unary_stream  # grpc.aio's: an async generator function

        async def checked_stream(request: Any, context: grpc.aio.ServicerContext):
            await _check_role(context, principal)
            async for item in stream(request, context):
                yield item

        return grpc.unary_stream_rpc_method_handler(checked_stream, **kwargs)
    unary: Any = handler.unary_unary  # grpc.aio's: a coroutine function

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _check_role(context, principal)
        return await unary(request, context)

    return grpc.unary_unary_rpc_method_handler(checked, **kwargs)
