"""The HTTP handlers of the router (see router.api.server for the contract).

One generation path for both endpoints: validate (router.api.protocol, with the parameter
policy of router.api.params) -> tokenize -> place -> run the samples and answer
(router.api.generation: one body or SSE chunks). A request asking for top logprobs is prefilled
or seeded sampling is prefilled on its decode node, where its first token is sampled
(`_needs_local_prefill`). Leaving the run (stop, disconnect, error) aborts the
request on its nodes. Deltas come through `router.routing.migration.execute_migrating`, so a request
whose decode node is lost mid-stream continues on another node within the same response. An
error after the stream has started (no move left, no healthy node) is sent as an SSE event
`{"error": {...}}` followed by `[DONE]`: the `openai` client raises it as an `APIError`.

API: `Handlers`.
"""

from __future__ import annotations

import logging

from aiohttp import web
from opentelemetry import trace

from pdcluster.core import tracing
from pdcluster.router.api.admission_gate import AdmissionGate
from pdcluster.router.api.edge import json_error
from pdcluster.router.api.fanout import local_placement
from pdcluster.router.api.generation import EndedWithError, Generation
from pdcluster.router.api.protocol import CompletionRequest, parse_chat, parse_completion
from pdcluster.router.api.request_prep import read_json, resolve_prompt
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.config import RouterConfig
from pdcluster.router.errors import ApiError, NodeFailure, NoHealthyNode, api_error
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.routing.dispatch import Dispatcher, Placement
from pdcluster.router.routing.handoff import HotPrefixes
from pdcluster.router.tenants import ApiKeys, TenantSalts

logger = logging.getLogger(__name__)


class Handlers:
    def __init__(self, config: RouterConfig, tokenizer: RouterTokenizer, model_name: str,
                 metrics: RouterMetrics, dispatcher: Dispatcher,
                 hot_prefixes: HotPrefixes | None = None) -> None:
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        self._metrics, self.dispatcher = metrics, dispatcher
        self.hot_prefixes = hot_prefixes  # what a draining node hands off (routing.handoff)
        self._api_keys = ApiKeys(config.api_keys)
        self._salts = TenantSalts(config.cache_salt_key) if self._api_keys.enabled else None
        self.admission = (AdmissionGate(config.admission, dispatcher, metrics,
                                        config.load_interval_s)
                          if config.admission is not None else None)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        try:
            self._api_keys.authenticate(request)
        except ApiError as exc:
            return json_error(exc)
        card = {"id": self.model_name, "object": "model", "created": 0,
                "owned_by": "pdcluster", "max_model_len": self.tokenizer.max_model_len}
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        """On the public port, behind the API key (refused outright when an admin port
        serves them): the router's counters are every tenant's."""
        try:
            if self.config.admin_port is not None:
                raise ApiError(404, "metrics are served on the admin port", None, "not_found")
            self._api_keys.authenticate(request)
        except ApiError as exc:
            return json_error(exc)
        return await self.admin_metrics(request)

    async def admin_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics.render(),
                            content_type="text/plain", charset="utf-8")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        # the request's trace (core.tracing): continues a client's traceparent, if sent
        with tracing.tracer().start_as_current_span(
                "router.request", context=tracing.parent_context(
                    request.headers.get("traceparent")),
                kind=trace.SpanKind.SERVER,
                attributes={"pdcluster.component": "router", "pdcluster.endpoint": endpoint}
        ) as span:
            response = await self._answer(request, chat, endpoint)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _answer(self, request: web.Request, chat: bool,
                      endpoint: str) -> web.StreamResponse:
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
        except EndedWithError as exc:
            counter.labels(endpoint, str(exc.status)).inc()
            return exc.response
        counter.labels(endpoint, str(response.status)).inc()
        return response

    async def _checked(self, request: web.Request, chat: bool) -> web.StreamResponse:
        tenant = self._api_keys.authenticate(request)
        body = await read_json(request, self.config.max_body_bytes,
                               self.config.body_timeout_s)
        req = parse_chat(body) if chat else parse_completion(body)
        if self._salts is not None:  # tenants never share a cache
            req.cache_salt = self._salts.salt(tenant, req.cache_salt)
        prompt = resolve_prompt(req, self.tokenizer, self.model_name,
                                self.config.max_tokens_limit)
        async def place() -> Placement:
            placed = await self.dispatcher.place(prompt.token_ids, req.cache_salt)
            return local_placement(placed) if _needs_local_prefill(req) else placed

        on_first_token = None
        if self.admission is not None:
            gate = self.admission
            priority = gate.config.priority(request.headers.get(gate.config.header),
                                            tenant.name if tenant is not None else None)
            placement, prediction = await gate.admit(place, len(prompt.token_ids), priority)
            on_first_token = lambda ttft: gate.observe(prediction, ttft)  # noqa: E731
        else:
            placement = await place()
        self._count(placement, len(prompt.token_ids))
        decision = placement.decision
        trace.get_current_span().set_attributes({
            "pdcluster.decode_node": decision.decode_node,
            "pdcluster.prefill_node": decision.prefill_node or decision.decode_node,
            "pdcluster.prompt_tokens": len(prompt.token_ids),
            "pdcluster.cached_tokens": decision.cached_tokens})
        self._remember(placement, prompt.token_ids, req.cache_salt)
        generation = Generation(req, prompt, self.model_name, self.tokenizer, self._metrics,
                                on_first_token)
        return await generation.respond(request, self.dispatcher, placement)

    def _remember(self, placement: Placement, token_ids: list[int],
                  cache_salt: str | None) -> None:
        """Both nodes of a placement hold the prompt's blocks afterwards."""
        if self.hot_prefixes is None or not placement.chain:
            return
        decision = placement.decision
        for node_id in {decision.decode_node, decision.prefill_node or decision.decode_node}:
            self.hot_prefixes.record(node_id, token_ids, cache_salt, placement.chain)

    def _count(self, placement: Placement, num_prompt: int) -> None:
        m, d = self._metrics, placement.decision
        reason = "load_only" if placement.load_only else d.reason
        m.decisions.labels(d.decode_node, "decode", reason).inc()
        if d.prefill_node is not None:
            m.decisions.labels(d.prefill_node, "prefill", reason).inc()
        m.prompt_tokens.inc(num_prompt)
        m.prefix_hit_tokens.inc(d.cached_tokens)


def _needs_local_prefill(req: CompletionRequest) -> bool:
    """Requests whose first token must be sampled where the rest is: top logprobs (a remote
    prefill sends the first token's logprob but not its alternatives) and seeded sampling
    (the decode node would start the seed's generator afresh after the prefill node's draw,
    repeating it: not what the same request prefilled locally gives)."""
    sampling = req.sampling
    return bool(sampling.logprobs) or (sampling.seed is not None and sampling.temperature > 0)
