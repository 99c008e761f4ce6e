"""The OpenAI-compatible HTTP API (aiohttp): /v1/completions, /v1/chat/completions (SSE
streaming with an optional final usage chunk, or one JSON body), /v1/models, vLLM's
/tokenize, /detokenize and /version, /health (503 when the router cannot serve; the reason and
the nodes' state only with an API key) and /metrics (Prometheus; behind the API key, or on the
admin port `admin_port`, which also serves the detailed /health without a key).

Every client mistake is a 4xx in OpenAI's error shape (never a traceback), and so is every
other error status: unknown routes, wrong methods, oversized or slow requests, unexpected
exceptions (router.api.edge, which also bounds request heads and bodies in size and time); no
healthy node is 503 with Retry-After; a client that disconnects has its request aborted on the
nodes (the handler is cancelled, and `Dispatcher.execute`'s cleanup sends AbortRequest). API
keys, if configured, are checked in constant time. This module sets the app up and shuts it
down; the generation handlers are in router.api.handlers, the other endpoints in
router.api.extra_routes, the request checks in router.api.request_prep and the errors and their HTTP
statuses in router.errors.

API: `RouterApp` (`start()` / `stop()`, `port`, `admin_port`), `build_apps`,
`serve_forever(config)`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from pdcluster.core.credentials import CurveKeys
from pdcluster.router.api.edge import EdgeRunner, error_middleware
from pdcluster.router.api.extra_routes import ExtraRoutes
from pdcluster.router.api.handlers import Handlers
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.config import RouterConfig
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.planning.tenant_limits import TenantLimiter
from pdcluster.router.routing.dispatch import Dispatcher
from pdcluster.router.routing.handoff import DrainWatcher, HotPrefixes

logger = logging.getLogger(__name__)


class RouterApp:
    def __init__(self, config: RouterConfig, shared_keys: CurveKeys | None = None) -> None:
        """`shared_keys`: see `Dispatcher` (static nodes in tests and benchmarks)."""
        self.config = config
        self.tokenizer = RouterTokenizer(config.model_dir)
        self.model_name = config.model_name or config.model_dir.rstrip("/").rsplit("/", 1)[-1]
        self.metrics = RouterMetrics()
        self.dispatcher = Dispatcher(config, self.metrics, shared_keys=shared_keys)
        # scale-in that keeps the cache: a draining node's hot prompts go to its peers
        self.hot_prefixes = HotPrefixes()
        self.drain_watcher = DrainWatcher(self.dispatcher, self.hot_prefixes)
        # parses and tokenizes request bodies off the event loop (router.api.handlers)
        self.prep_pool = ThreadPoolExecutor(config.prep_threads, thread_name_prefix="router-prep")
        self.tenant_limiter = TenantLimiter(config.tenant_limits, self.metrics.tenant_limited.inc)
        self._runner: web.AppRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self.port = config.port
        self.admin_port = config.admin_port

    async def start(self) -> None:
        await self.dispatcher.start()
        self.drain_watcher.start(self.config.load_interval_s)
        public, admin = build_apps(self)
        self._runner = EdgeRunner(public, self.config)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        self.port = self._runner.addresses[0][1]
        for address in self.config.also_listen:  # the same port (the one picked for port 0)
            await web.TCPSite(self._runner, address, self.port).start()
        if admin is not None:
            self._admin_runner = EdgeRunner(admin, self.config)
            await self._admin_runner.setup()
            await web.TCPSite(self._admin_runner, self.config.admin_host,
                              self.config.admin_port).start()
            self.admin_port = self._admin_runner.addresses[0][1]

    async def stop(self) -> None:
        await self.drain_watcher.close()
        for runner in (self._runner, self._admin_runner):
            if runner is not None:
                await runner.cleanup()
        await self.dispatcher.close()
        self.prep_pool.shutdown(wait=False, cancel_futures=True)


def build_apps(router: RouterApp) -> tuple[web.Application, web.Application | None]:
    """The public app, and the admin app (/metrics, the detailed /health; no API key) when
    `admin_port` is set."""
    handlers = Handlers(router.config, router.tokenizer, router.model_name, router.metrics,
                        router.dispatcher, router.prep_pool, router.tenant_limiter,
                        router.hot_prefixes)
    extra = ExtraRoutes(router.config, router.tokenizer, router.model_name, router.dispatcher,
                        router.prep_pool, router.drain_watcher)
    admin = None
    if router.config.admin_port is not None:
        admin = web.Application(middlewares=[error_middleware])
        admin.router.add_get("/metrics", handlers.admin_metrics)
        admin.router.add_get("/health", extra.admin_health)
    return _public_app(router, handlers, extra), admin


def _public_app(router: RouterApp, handlers: Handlers, extra: ExtraRoutes) -> web.Application:
    app = web.Application(client_max_size=router.config.max_body_bytes + 1,
                          middlewares=[error_middleware])
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/tokenize", extra.tokenize)
    app.router.add_post("/detokenize", extra.detokenize)
    app.router.add_get("/version", extra.version)
    app.router.add_get("/health", extra.health)
    app.router.add_get("/metrics", handlers.metrics)
    return app


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
