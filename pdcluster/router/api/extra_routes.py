"""The router's endpoints besides generation, in vLLM's shapes:

- `POST /tokenize`: `{"prompt": str, "add_special_tokens": true}` or `{"messages": [...],
  "add_generation_prompt": true, "add_special_tokens": false}` (the chat template, as
  /v1/chat/completions renders it), optional `model` and `return_token_strs` ->
  `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` null unless asked);
- `POST /detokenize`: `{"tokens": [int]}` -> `{"prompt": str}` (special tokens kept);
- `GET /version`: `{"version": ...}` from the installed package's metadata;
- `GET /health`: 200 when the router can serve, else 503. Without an API key (probes carry
  none) only `{"status"}`; with one, or on the admin port, also the `reason` (no node known,
  no healthy decode node), the nodes' and the metadata link's state, the cluster's KV identity
  (`kv_identity`, with the router's own tokenizer digest) and the nodes quarantined for
  registering another one (`quarantined`: node -> the fields that differ and why). A metadata
  service that is down does not stop serving (routing falls back to load only), so on its own
  it is not a reason.

The first three take the API key like /v1/*.

API: `ExtraRoutes`, `serving_problem`.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from importlib import metadata
from typing import Any

from aiohttp import web

from pdcluster.core.roles import Role
from pdcluster.router.api.edge import RETRY_AFTER_S, json_error, read_body
from pdcluster.router.api.protocol import parse_chat
from pdcluster.router.api.request_prep import parse_json
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.config import RouterConfig
from pdcluster.router.errors import ApiError
from pdcluster.router.routing.dispatch import Dispatcher
from pdcluster.router.routing.handoff import DrainWatcher
from pdcluster.router.tenants import ApiKeys

# vLLM's chat-tokenize fields that change the rendering and that this router does not do:
# refused when set rather than ignored.
_UNSUPPORTED_CHAT_FIELDS = ("continue_final_message", "chat_template", "chat_template_kwargs",
                            "tools", "mm_processor_kwargs", "media_io_kwargs")


def _api_errors(handler):
    """An endpoint whose `ApiError`s become OpenAI error responses."""

    @functools.wraps(handler)
    async def wrapper(self, request: web.Request) -> web.StreamResponse:
        try:
            return await handler(self, request)
        except ApiError as exc:
            return json_error(exc)

    return wrapper


class ExtraRoutes:
    def __init__(self, config: RouterConfig, tokenizer: RouterTokenizer, model_name: str,
                 dispatcher: Dispatcher, prep: Executor,
                 drain_watcher: DrainWatcher | None = None) -> None:
        """`prep`: the pool that tokenizes off the event loop (router.api.handlers)."""
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self._prep = prep
        self.dispatcher = dispatcher
        self.drain_watcher = drain_watcher
        self._api_keys = ApiKeys(config.api_keys)

    async def _body(self, request: web.Request) -> dict:
        self._api_keys.authenticate(request)
        raw = await read_body(request, self.config.max_body_bytes, self.config.body_timeout_s)
        body = await asyncio.get_running_loop().run_in_executor(self._prep, parse_json, raw)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"the model '{model}' does not exist", "model",
                           "model_not_found")
        return body

    @_api_errors
    async def tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ids, strings = await asyncio.get_running_loop().run_in_executor(
            self._prep, self._tokenized, body)
        return web.json_response({"count": len(ids),
                                  "max_model_len": self.tokenizer.max_model_len,
                                  "tokens": ids, "token_strs": strings})

    def _tokenized(self, body: dict) -> tuple[list[int], list[str] | None]:
        """The ids of `body`'s prompt or messages, and their strings if asked (a thread)."""
        ids = self._chat_ids(body) if "messages" in body else self._prompt_ids(body)
        strings = (self.tokenizer.token_strings(ids)
                   if _flag(body, "return_token_strs", False) else None)
        return ids, strings

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "'prompt' (a string) or 'messages' is required", "prompt",
                           "invalid_value")
        return self.tokenizer.encode(prompt, _flag(body, "add_special_tokens", True))

    def _chat_ids(self, body: dict) -> list[int]:
        if "prompt" in body:
            raise ApiError(400, "give either 'prompt' or 'messages', not both", "prompt",
                           "invalid_value")
        for name in _UNSUPPORTED_CHAT_FIELDS:
            if body.get(name):
                raise ApiError(400, f"'{name}' is not supported", name, "unsupported_parameter")
        # the messages are checked exactly as /v1/chat/completions checks them
        messages = parse_chat({"model": self.model_name, "messages": body.get("messages")})
        try:
            return self.tokenizer.apply_chat_template(
                messages.messages, _flag(body, "add_generation_prompt", True),
                _flag(body, "add_special_tokens", False))
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages") from None

    @_api_errors
    async def detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens = body.get("tokens")
        vocab = self.tokenizer.vocab_size
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                for t in tokens):
            raise ApiError(400, f"'tokens' must be a list of token ids in [0, {vocab})",
                           "tokens", "invalid_value")
        text = await asyncio.get_running_loop().run_in_executor(
            self._prep, self.tokenizer.decode, tokens, False)
        return web.json_response({"prompt": text})

    @_api_errors
    async def version(self, request: web.Request) -> web.Response:
        self._api_keys.authenticate(request)
        return web.json_response({"version": package_version()})

    async def health(self, request: web.Request) -> web.Response:
        """The public probe: the status alone; the internals (node ids, the metadata address,
        every tenant's traffic) are for operators: on the admin port when there is one (any
        tenant's key reads nothing more here), else to a key holder (or with no keys)."""
        if self.config.admin_port is not None or (
                self._api_keys.enabled and self._api_keys.tenant_of(request) is None):
            return self._health_response({"status": self._status()})
        return await self.admin_health(request)

    async def admin_health(self, request: web.Request) -> web.Response:
        dispatcher = self.dispatcher
        nodes = {n.node_id: {"role": n.spec.role, "healthy": n.healthy,
                             "connected": not n.disconnected, "inflight": n.num_inflight,
                             "draining": n.report is not None and n.report.draining}
                 for n in dispatcher.nodes.values()}
        problem = serving_problem(dispatcher)
        link = dispatcher.metadata
        handoffs = {} if self.drain_watcher is None else {
            node_id: status.as_dict() for node_id, status in self.drain_watcher.status.items()}
        body = {"status": self._status(), "reason": problem, "nodes": nodes,
                "draining": handoffs,
                "routing": _routing(self.config.routing, dispatcher.prefix_aware),
                **_identity(dispatcher),
                "metadata": None if link is None else {
                    "address": link.address, "available": link.available,
                    "last_error": link.last_error, "mirror_in_sync": link.mirror_in_sync,
                    "mirror_blocks": link.mirror_blocks, "watch_error": link.watch_error,
                    "mirror_node_blocks": link.mirror_node_blocks(),
                    "stale_answers": link.stale_answers,
                    # claims this router vouches for / claimed blocks it never gave the node
                    "attested_node_blocks": _attested(dispatcher),
                    "unattested_claims": (None if dispatcher.attestations is None
                                          else dict(dispatcher.attestations.unattested_claims))}}
        return self._health_response(body)

    def _status(self) -> str:
        return "ok" if serving_problem(self.dispatcher) is None else "unavailable"

    @staticmethod
    def _health_response(body: dict) -> web.Response:
        if body["status"] == "ok":
            return web.json_response(body)
        return web.json_response(body, status=503, headers={"Retry-After": RETRY_AFTER_S})


def _identity(dispatcher: Dispatcher) -> dict[str, Any]:
    identity = dispatcher.identity
    return {"kv_identity": identity.as_dict(),
            "router_tokenizer_digest": identity.tokenizer_digest,
            "quarantined": {node_id: {"mismatch": list(verdict.fields), "reason": verdict.reason}
                            for node_id, verdict in identity.quarantined.items()}}


def _attested(dispatcher: Dispatcher) -> dict[str, int] | None:
    table = dispatcher.attestations
    return None if table is None else {n: table.num_held(n) for n in table.held.node_ids}


def _routing(routing: str, prefix_aware: bool) -> str:
    """What /health reports: a baseline by name, else whether prefix hits are used."""
    if routing != "kv":
        return routing
    return "prefix_aware" if prefix_aware else "load_only"


def serving_problem(dispatcher: Dispatcher) -> str | None:
    """Why the router cannot serve a request now, or None: it needs a healthy node that can
    decode (a decode node, or one of either role); prefill nodes alone cannot answer."""
    nodes = list(dispatcher.nodes.values())
    link = dispatcher.metadata
    if not nodes:
        if link is not None and not link.available:
            return f"no node known: the metadata service is unavailable ({link.last_error})"
        if dispatcher.identity.quarantined:
            return (f"no node known: {len(dispatcher.identity.quarantined)} registered nodes "
                    f"quarantined, their KV identity differs from the cluster's")
        return "no node known"
    if any(n.healthy and n.spec.role != Role.PREFILL for n in nodes):
        return None
    num_healthy = sum(n.healthy for n in nodes)
    return (f"no healthy decode node ({len(nodes)} nodes known, {num_healthy} healthy, "
            f"none of them able to decode)")


@functools.cache
def package_version() -> str:
    try:
        return metadata.version("pdcluster")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "0+unknown"


def _flag(body: dict, name: str, default: bool) -> bool:
    value: Any = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", name, "invalid_type")
    return value
