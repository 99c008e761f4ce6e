"""The HTTP handlers of the router (see router.server for the contract).

One generation path for both endpoints: validate -> tokenize -> place -> execute, then either
stream SSE chunks (the response is prepared only when the first tokens arrive, so a node that
refuses still yields a proper JSON error status) or collect one body. A stop string ends the
stream early; leaving the `execute` generator (stop, disconnect, error) aborts the request on
its nodes. Deltas come through `router.migration.execute_migrating`, so a request whose
decode node is lost mid-stream continues on another node within the same response. An error
after the stream has started (no move left, no healthy node) is sent as an SSE event
`{"error": {...}}` followed by `[DONE]`: the `openai` client raises it as an `APIError`.

API: `Handlers`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field

from aiohttp import web

from pdcluster.core.node_wire import TokenDelta
from pdcluster.router.config import RouterConfig
from pdcluster.router.dispatch import Dispatcher, Placement
from pdcluster.router.errors import ApiError, NodeFailure, NoHealthyNode, api_error, error_body
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.migration import execute_migrating
from pdcluster.router.protocol import CompletionRequest, parse_chat, parse_completion
from pdcluster.router.request_prep import check_auth, make_generate, read_json, resolve_prompt
from pdcluster.router.tokenizer import IncrementalDetokenizer, RouterTokenizer

logger = logging.getLogger(__name__)
RETRY_AFTER_S = "1"


@dataclass(slots=True)
class _Result:
    text: str = ""
    num_tokens: int = 0
    num_cached: int = 0
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)


class _EndedWithError(Exception):
    """A stream that had started ended with an error event (sent already)."""

    def __init__(self, response: web.StreamResponse, status: int) -> None:
        super().__init__(status)
        self.response, self.status = response, status


class Handlers:
    def __init__(self, config: RouterConfig, tokenizer: RouterTokenizer, model_name: str,
                 metrics: RouterMetrics, dispatcher: Dispatcher) -> None:
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self._metrics, self.dispatcher = metrics, dispatcher
        self._keys = [k.encode() for k in config.api_keys]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        try:
            check_auth(request, self._keys)
        except ApiError as exc:
            return json_error(exc)
        card = {"id": self.model_name, "object": "model", "created": 0,
                "owned_by": "pdcluster", "max_model_len": self.tokenizer.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        dispatcher = self.dispatcher
        nodes = {n.node_id: {"role": n.spec.role, "healthy": n.healthy,
                             "connected": not n.disconnected, "inflight": n.num_inflight}
                 for n in dispatcher.nodes.values()}
        healthy = any(n.healthy for n in dispatcher.nodes.values())
        link = dispatcher.metadata
        body = {"status": "ok" if healthy else "unavailable", "nodes": nodes,
                "routing": "prefix_aware" if dispatcher.prefix_aware else "load_only",
                "metadata": None if link is None else {
                    "address": link.address, "available": link.available,
                    "last_error": link.last_error, "mirror_in_sync": link.mirror_in_sync,
                    "mirror_blocks": link.mirror_blocks, "watch_error": link.watch_error}}
        return web.json_response(body, status=200 if healthy else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(),
                            content_type="text/plain", charset="utf-8")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        counter = self._metrics.requests
        try:
            response = await self._checked(request, chat)
        except ApiError as exc:
            counter.labels(endpoint, str(exc.status)).inc()
            return json_error(exc)
        except (NoHealthyNode, NodeFailure) as exc:
            error = api_error(exc)
            counter.labels(endpoint, str(error.status)).inc()
            return json_error(error)
        except _EndedWithError as exc:
            counter.labels(endpoint, str(exc.status)).inc()
            return exc.response
        counter.labels(endpoint, str(response.status)).inc()
        return response

    async def _checked(self, request: web.Request, chat: bool) -> web.StreamResponse:
        check_auth(request, self._keys)
        body = await read_json(request, self.config.max_body_bytes)
        req = parse_chat(body) if chat else parse_completion(body)
        prompt = resolve_prompt(req, self.tokenizer, self.model_name,
                                self.config.max_tokens_limit)
        ids = prompt.token_ids
        placement = await self.dispatcher.place(ids, req.cache_salt)
        self._count(placement, len(ids))
        started = time.perf_counter()
        node_request = make_generate(req, prompt, list(self.tokenizer.eos_token_ids))
        deltas = execute_migrating(self.dispatcher, placement, node_request)
        async with aclosing(deltas):
            if req.stream:
                return await self._stream(request, req, deltas, len(ids), started)
            result = await self._collect(req, deltas, started)
        return web.json_response(self._body(req, node_request.request_id, result, len(ids)))

    def _count(self, placement: Placement, num_prompt: int) -> None:
        m, d = self._metrics, placement.decision
        reason = "load_only" if placement.load_only else d.reason
        m.decisions.labels(d.decode_node, "decode", reason).inc()
        if d.prefill_node is not None:
            m.decisions.labels(d.prefill_node, "prefill", reason).inc()
        m.prompt_tokens.inc(num_prompt)
        m.prefix_hit_tokens.inc(d.cached_tokens)

    async def _collect(self, req: CompletionRequest, deltas, started: float) -> _Result:
        result, detok = _Result(), IncrementalDetokenizer(self.tokenizer, req.stop)
        async for delta in deltas:
            text = self._absorb(result, delta, detok, started)
            result.text += text
            if detok.stopped or delta.finished:
                break
        self._metrics.e2e.observe(time.perf_counter() - started)
        return result

    def _absorb(self, result: _Result, delta: TokenDelta, detok, started: float) -> str:
        metrics = self._metrics
        now = time.perf_counter()
        if result.num_tokens == 0:
            metrics.ttft.observe(now - started)
        result.num_tokens += len(delta.token_ids)
        result.num_cached = max(result.num_cached, delta.num_cached_tokens)
        result.logprobs += delta.logprobs or []
        text = detok.add(delta.token_ids, final=delta.finished)
        if detok.stopped:
            result.finish_reason = "stop"
        elif delta.finished:
            result.finish_reason = "stop" if delta.finish_reason == "stop" else "length"
            if delta.finish_reason in ("abort", "error"):
                raise NodeFailure("internal", delta.error or "the node aborted the request")
        return text

    async def _stream(self, request: web.Request, req: CompletionRequest, deltas,
                      num_prompt: int, started: float) -> web.StreamResponse:
        request_id = f"cmpl-{uuid_hex()}"
        stream = _SseStream(request, request_id)
        try:
            return await self._stream_into(stream, req, deltas, num_prompt, started)
        except (NoHealthyNode, NodeFailure) as exc:
            if stream.response is None:
                raise
            error = api_error(exc)
            await _send(stream.response, error_body(error))
            await stream.response.write(b"data: [DONE]\n\n")
            await stream.response.write_eof()
            raise _EndedWithError(stream.response, error.status) from exc

    async def _stream_into(self, stream: _SseStream, req: CompletionRequest, deltas,
                           num_prompt: int, started: float) -> web.StreamResponse:
        result, detok = _Result(), IncrementalDetokenizer(self.tokenizer, req.stop)
        request, request_id, last = stream.request, stream.request_id, started
        response: web.StreamResponse | None = None
        async for delta in deltas:
            text = self._absorb(result, delta, detok, started)
            if response is None:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
                await response.prepare(request)
                stream.response = response
                if req.chat:
                    await _send(response, _chunk(req, request_id, {"role": "assistant",
                                                                   "content": ""}, None))
            else:
                self._metrics.itl.observe(time.perf_counter() - last)
            last = time.perf_counter()
            if text or result.finish_reason:
                await _send(response, _chunk(req, request_id, text, result.finish_reason))
            if result.finish_reason:
                break
        if response is None:
            raise NodeFailure("internal", "the node ended the stream without a token")
        if req.include_usage:
            usage = _usage(num_prompt, result)
            await _send(response, {**_chunk(req, request_id, "", None), "choices": [],
                                   "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self._metrics.e2e.observe(time.perf_counter() - started)
        return response

    def _body(self, req: CompletionRequest, request_id: str, result: _Result,
              num_prompt: int) -> dict:
        name = self.model_name
        if req.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": result.finish_reason}
            kind = "chat.completion"
        else:
            logprobs = ({"tokens": None, "token_logprobs": result.logprobs,
                         "top_logprobs": None, "text_offset": None}
                        if req.logprobs is not None else None)
            choice = {"index": 0, "text": result.text, "logprobs": logprobs,
                      "finish_reason": result.finish_reason}
            kind = "text_completion"
        return {"id": f"cmpl-{request_id}", "object": kind, "created": now_s(), "model": name,
                "choices": [choice], "usage": _usage(num_prompt, result)}


@dataclass(slots=True)
class _SseStream:
    request: web.Request
    request_id: str
    response: web.StreamResponse | None = None


def json_error(exc: ApiError) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if exc.status == 503 else None
    return web.json_response(error_body(exc), status=exc.status, headers=headers)


def now_s() -> int:
    return int(time.time())


def uuid_hex() -> str:
    return uuid.uuid4().hex


def _usage(num_prompt: int, result: _Result) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": result.num_tokens,
            "total_tokens": num_prompt + result.num_tokens,
            "prompt_tokens_details": {"cached_tokens": result.num_cached}}


def _chunk(req: CompletionRequest, request_id: str, content: str | dict,
           finish_reason: str | None) -> dict:
    if req.chat:
        delta = content if isinstance(content, dict) else {"content": content}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": content, "logprobs": None, "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": now_s(), "model": req.model,
            "choices": [choice]}


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
