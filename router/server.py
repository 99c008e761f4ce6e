"""The OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions (SSE
streaming with an optional final usage chunk, or one JSON body), /v1/models, /health and
/metrics (Prometheus).

Every client mistake is a 4xx in OpenAI's error shape (never a traceback); no healthy node is
503 with Retry-After; a client that disconnects has its request aborted on the nodes (the
handler is cancelled, and `Dispatcher.execute`'s cleanup sends AbortRequest). API keys, if
configured, are checked in constant time.

API: `RouterApp` (`start()` / `stop()`, `port`), `build_app`, `serve_forever(config)`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
import uuid

from aiohttp import web

from core.node_wire import GenerateRequest
from router.config import RouterConfig
from router.dispatch import Dispatcher, NodeFailure, sampling_spec
from router.metrics import RouterMetrics
from router.policy import NoHealthyNode
from router.protocol import ApiError, CompletionRequest, error_body
from router.tokenizer import IncrementalDetokenizer, RouterTokenizer

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"
_NODE_ERROR_STATUS = {"invalid_request": 400, "overloaded": 503, "draining": 503}


class RouterApp:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer = RouterTokenizer(config.model_dir)
        self.model_name = config.model_name or config.model_dir.rstrip("/").rsplit("/", 1)[-1]
        self.metrics = RouterMetrics()
        self.dispatcher = Dispatcher(config, self.metrics)
        self._keys = [k.encode() for k in config.api_keys]
        self._runner: web.AppRunner | None = None
        self.port = config.port

    async def start(self) -> None:
        await self.dispatcher.start()
        self._runner = web.AppRunner(build_app(self), handler_cancellation=True,
                                     access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        await self.dispatcher.close()

    # -- checks -------------------------------------------------------------------------

    def check_auth(self, request: web.Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("Authorization", "")
        given = header[7:].encode() if header.startswith("Bearer ") else b""
        if not any(hmac.compare_digest(given, key) for key in self._keys):
            raise ApiError(401, "invalid or missing API key", None, "invalid_api_key",
                           "authentication_error")

    async def read_json(self, request: web.Request) -> object:
        limit = self.config.max_body_bytes
        if (request.content_length or 0) > limit:
            raise ApiError(413, f"request body larger than {limit} bytes", None,
                           "request_too_large")
        raw = await request.content.read(limit + 1)
        if len(raw) > limit:
            raise ApiError(413, f"request body larger than {limit} bytes", None,
                           "request_too_large")
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not valid UTF-8", None,
                           "invalid_encoding") from None
        except (json.JSONDecodeError, RecursionError):
            raise ApiError(400, "the request body is not valid JSON", None,
                           "invalid_json") from None

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        if req.model != self.model_name:
            raise ApiError(404, f"the model '{req.model}' does not exist", "model",
                           "model_not_found")
        try:
            if req.chat:
                ids = self.tokenizer.apply_chat_template(req.messages)
            elif isinstance(req.prompt, str):
                ids = self.tokenizer.encode(req.prompt)
            else:
                ids = req.prompt
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages" if req.chat else "prompt") from None
        context = self.tokenizer.max_model_len
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", "prompt")
        if len(ids) >= context:
            raise ApiError(400, f"this model's maximum context length is {context} tokens; "
                           f"the prompt has {len(ids)}", "messages" if req.chat else "prompt",
                           "context_length_exceeded")
        room = context - len(ids)
        if req.max_tokens is None:
            req.max_tokens = min(room, self.config.max_tokens_limit) if req.chat else min(16, room)
        if req.max_tokens > min(room, self.config.max_tokens_limit):
            raise ApiError(400, f"max_tokens={req.max_tokens} is too large: the prompt has "
                           f"{len(ids)} tokens and the context is {context} (limit "
                           f"{self.config.max_tokens_limit})", "max_tokens",
                           "context_length_exceeded")
        return ids


def build_app(router: RouterApp) -> web.Application:
    from router.handlers import Handlers

    handlers = Handlers(router)
    app = web.Application(client_max_size=router.config.max_body_bytes + 1)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    return app


def json_error(exc: ApiError) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if exc.status == 503 else None
    return web.json_response(error_body(exc), status=exc.status, headers=headers)


def node_api_error(exc: NodeFailure | NoHealthyNode) -> ApiError:
    if isinstance(exc, NoHealthyNode):
        return ApiError(503, f"no healthy node can serve the request: {exc}", None,
                        "no_healthy_node", "service_unavailable")
    status = _NODE_ERROR_STATUS.get(exc.code, 502)
    return ApiError(status, f"the node refused the request: {exc}", None, exc.code,
                    "invalid_request_error" if status == 400 else "server_error")


def make_generate(router: RouterApp, req: CompletionRequest, ids: list[int]) -> GenerateRequest:
    spec = sampling_spec(req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed,
                         req.logprobs, list(router.tokenizer.eos_token_ids))
    return GenerateRequest(uuid.uuid4().hex, ids, spec, None, req.cache_salt)


def new_detokenizer(router: RouterApp, req: CompletionRequest) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(router.tokenizer, req.stop)


def now_s() -> int:
    return int(time.time())


async def wait_for_signal() -> None:
    """Until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_forever(config: RouterConfig, on_ready=None) -> None:
    """Run the router until SIGINT/SIGTERM; `on_ready(base_url)` once it listens."""
    app = RouterApp(config)
    await app.start()
    base_url = f"http://{config.host}:{app.port}/v1"
    logger.info("router listening at %s", base_url)
    if on_ready is not None:
        on_ready(base_url)
    try:
        await wait_for_signal()
    finally:
        await app.stop()
