"""The router's typed errors and the one place they become HTTP statuses.

`ApiError` is a client-facing error in OpenAI's shape (status, message, param, code, type);
`NodeFailure` is a node that refused or lost a request; `NoHealthyNode` means no node can
take it. `api_error` maps the last two to an `ApiError`, so every handler answers the same
failure with the same status.

API: `ApiError`, `NodeFailure`, `NoHealthyNode`, `api_error`, `error_body`.
"""

from __future__ import annotations

# A node's refusal code -> HTTP status; any other code is a 502 (the node failed).
_NODE_ERROR_STATUS = {"invalid_request": 400, "overloaded": 503, "draining": 503}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, err_type: str = "invalid_request_error",
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code, self.type = code, err_type
        self.retry_after_s = retry_after_s  # a Retry-After header (429: shed by admission)


class NodeFailure(Exception):
    """A node refused or failed the request (`code` from core.node_wire.ERROR_CODES).
    `lost`: the node is gone (disconnected, stopped answering) rather than refusing, so the
    request may be moved elsewhere (router.routing.migration)."""

    def __init__(self, code: str, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.lost = lost


class NoHealthyNode(Exception):
    """No node can take the request (none known, all draining, or none of the needed role)."""


def api_error(exc: NodeFailure | NoHealthyNode) -> ApiError:
    """The client-facing error for a node-side failure: 503 when no node is healthy or the
    node is overloaded or draining, 400 when it found the request invalid, 502 otherwise
    (including a node lost while serving)."""
    if isinstance(exc, NoHealthyNode):
        return ApiError(503, f"no healthy node can serve the request: {exc}", None,
                        "no_healthy_node", "service_unavailable")
    if exc.lost:  # gone, not a refusal
        return ApiError(502, f"the node serving the request failed: {exc}", None, exc.code,
                        "server_error")
    status = _NODE_ERROR_STATUS.get(exc.code, 502)
    return ApiError(status, f"the node refused the request: {exc}", None, exc.code,
                    "invalid_request_error" if status == 400 else "server_error")


def error_body(exc: ApiError) -> dict:
    return {"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                      "code": exc.code}}
