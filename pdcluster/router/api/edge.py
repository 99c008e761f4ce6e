"""The router's HTTP edge: what happens to a connection before and around the handlers.

- Request heads: a connection must deliver its first request head within
  `header_timeout_s` of opening, and after each response the next head within the same time
  (aiohttp's keep-alive timer, set to it); a request line or header line longer than
  `max_header_bytes` is 431, more than `max_headers` headers 400.
- Bodies: `read_body` reads the whole body (the one read of aiohttp's stream returns only what
  has arrived) up to `max_body_bytes`, counting while it streams, so a chunked body with no
  Content-Length is cut at the limit (413) instead of buffered; a body that does not arrive
  within `body_timeout_s` is 408. Either closes the connection; whatever body is still
  coming is drained for at most `LINGERING_S` first, so a client that sends the whole body
  before reading still sees the status. `find_invalid_unicode` names the first string of a
  parsed body that holds a lone surrogate (valid JSON, not valid Unicode).
- Errors: every 4xx/5xx is OpenAI's JSON shape. `error_middleware` turns aiohttp's own
  HTTP errors (unknown route 404, wrong method 405 with its Allow header) into it, and any
  unexpected exception into a 500 that says nothing of the code (the traceback goes to the
  log); `EdgeRunner` does the same for the errors aiohttp answers before any handler runs
  (malformed request line, oversized headers).

API: `EdgeRunner`, `error_middleware`, `read_body`, `find_invalid_unicode`, `json_error`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from pdcluster.router.config import RouterConfig
from pdcluster.router.errors import ApiError, error_body

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
# At most this long (and never longer than the body timeout), a body left unread by an
# answered request is drained before the connection closes.
LINGERING_S = 10.0
# Statuses after which the connection is closed rather than kept alive: its body (if any)
# was not read, or it is a client too slow to keep.
_CLOSING_STATUSES = frozenset({408, 413})
_HTTP_ERROR_CODES = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
                     413: "request_too_large", 415: "unsupported_media_type"}


def json_error(exc: ApiError) -> web.Response:
    """The response of an `ApiError`: OpenAI's error body, Retry-After on a 503 and where
    the error names one (a request shed by admission)."""
    headers = {"Retry-After": RETRY_AFTER_S} if exc.status == 503 else None
    if exc.retry_after_s is not None:
        headers = {"Retry-After": str(exc.retry_after_s)}
    return web.json_response(error_body(exc), status=exc.status, headers=headers)


def _internal_error() -> ApiError:
    return ApiError(500, "internal server error", None, "internal_error", "server_error")


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """OpenAI-shaped bodies for aiohttp's HTTP errors and for unexpected exceptions; closes
    the connection after a 408 or a 413."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        response = _from_http_exception(exc)
    except ConnectionError:  # the client went away: nobody to answer, nothing to log
        raise
    except Exception:
        logger.exception("unhandled error serving %s %s", request.method, request.path)
        if request.writer.output_size > 0:  # a stream had started: nothing more to say
            raise
        response = json_error(_internal_error())
    if response.status in _CLOSING_STATUSES:
        response.force_close()
    return response


def _from_http_exception(exc: web.HTTPException) -> web.Response:
    status = exc.status
    code = _HTTP_ERROR_CODES.get(status, f"http_{status}")
    err_type = "invalid_request_error" if status < 500 else "server_error"
    response = json_error(ApiError(status, exc.reason, None, code, err_type))
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole request body: 413 past `limit` bytes (checked against Content-Length first,
    then while it streams), 408 if it has not all arrived within `timeout_s`."""
    if (request.content_length or 0) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.read(limit + 1 - size):
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", None,
                       "request_timeout") from None
    except web.RequestPayloadError as exc:  # bad chunk framing or content encoding
        raise ApiError(400, f"the request body could not be read: {exc}", None,
                       "invalid_body") from None
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body larger than {limit} bytes", None, "request_too_large")


def find_invalid_unicode(value: Any, path: str = "") -> str | None:
    """The path (`prompt`, `messages[0].content`, ...) of the first string in a parsed JSON
    value that is not valid Unicode (a lone surrogate, which JSON's \\u escapes allow), or
    None."""
    if isinstance(value, str):
        return None if _is_valid(value) else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not _is_valid(key):
                return where
            found = find_invalid_unicode(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_invalid_unicode(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _is_valid(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class _EdgeHandler(web.RequestHandler):
    """aiohttp's connection handler with a deadline for the first request head and JSON
    bodies for the errors it answers itself."""

    __slots__ = ("_head_timeout_s", "_head_timer")

    def __init__(self, manager: web.Server, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._head_timer = asyncio.get_running_loop().call_later(
            self._head_timeout_s, self._head_timed_out)

    def head_received(self) -> None:
        """The first request head is complete: keep-alive timing takes over."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        logger.debug("closing a connection that sent no complete request head in time")
        self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.head_received()
        super().connection_lost(exc)

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: the response had started
            return super().handle_error(request, status, exc, message)
        if status >= 500:
            logger.error("error serving a request", exc_info=exc)
            error = _internal_error()
        elif isinstance(exc, LineTooLong):
            error = ApiError(431, "a request header line is too long", None,
                             "header_too_large")
        else:
            error = ApiError(status, f"malformed HTTP request: {message or exc}", None,
                             "bad_http_request")
        response = web.Response(status=error.status, text=json.dumps(error_body(error)),
                                content_type="application/json")
        response.force_close()
        return response


class _EdgeServer(web.Server):
    """aiohttp's server, making `_EdgeHandler` connections and telling each when its first
    request head has arrived."""

    def __init__(self, handler, *, request_factory, head_timeout_s: float,
                 handler_cancellation: bool, **handler_kwargs: Any) -> None:
        super().__init__(handler, request_factory=request_factory,
                         handler_cancellation=handler_cancellation, **handler_kwargs)
        self._inner_factory = request_factory
        self.request_factory = self._make_edge_request
        self._handler_kwargs = handler_kwargs
        self._head_timeout_s = head_timeout_s

    def _make_edge_request(self, message, payload, protocol, writer, task):
        if isinstance(protocol, _EdgeHandler):
            protocol.head_received()
        return self._inner_factory(message, payload, protocol, writer, task)

    def __call__(self) -> _EdgeHandler:
        return _EdgeHandler(self, loop=asyncio.get_running_loop(),
                            head_timeout_s=self._head_timeout_s, **self._handler_kwargs)


class EdgeRunner(web.AppRunner):
    """`web.AppRunner` with the router's limits: heads, header sizes, keep-alive and
    lingering from `config`; connections made by `_EdgeServer`."""

    def __init__(self, app: web.Application, config: RouterConfig) -> None:
        self._handler_kwargs: dict[str, Any] = {
            "access_log": None, "keepalive_timeout": config.header_timeout_s,
            "max_line_size": config.max_header_bytes, "max_field_size": config.max_header_bytes,
            "max_headers": config.max_headers,
            "lingering_time": min(LINGERING_S, config.body_timeout_s)}
        self._head_timeout_s = config.header_timeout_s
        super().__init__(app, handler_cancellation=True, **self._handler_kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts the application up
        return _EdgeServer(server.request_handler, request_factory=server.request_factory,
                           head_timeout_s=self._head_timeout_s,
                           handler_cancellation=server.handler_cancellation,
                           **self._handler_kwargs)
