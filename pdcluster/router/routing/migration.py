"""Migration: a request whose decode node is lost mid-stream continues on another node.

`execute_migrating(dispatcher, placement, request)` yields one request's token deltas as one
stream across attempts; each attempt is `Dispatcher.execute`. When an attempt fails because
its decode node is *lost* (`NodeFailure.lost`: the connection closed, or the node stopped
answering load polls; never a refusal such as `invalid_request` or `overloaded`), and fewer
than `RouterConfig.max_migrations` moves were made, the request is placed again with
`Dispatcher.place` and continued:

    prompt     = original prompt + every token already streamed to the client
    max_tokens = original max_tokens - those tokens (min_tokens likewise)

under a fresh node request id. The lost node is unhealthy from the moment it is lost until
it reconnects and answers a load poll, so the policy cannot pick it again while it is gone
(no exclusion list is needed). The client sees one uninterrupted stream: the handler keeps
its completion id and counts usage on the original prompt.

Greedy sampling continues exactly (the new node recomputes the KV of prompt + generated and
picks the token one node would have picked). Seeded sampling is not reproduced: the new node
starts the seed's generator afresh.

With no move left, the lost node's `NodeFailure` is raised; with no healthy node left,
`NoHealthyNode`. The handler turns either into an error response (503 / 502), or into an SSE
error event once the stream has started.

API: `execute_migrating`, `continuation`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import replace

from pdcluster.core.node_wire import GenerateRequest, TokenDelta
from pdcluster.router.errors import NodeFailure, NoHealthyNode
from pdcluster.router.routing.dispatch import Dispatcher, Placement

logger = logging.getLogger(__name__)


async def execute_migrating(dispatcher: Dispatcher, placement: Placement,
                            request: GenerateRequest) -> AsyncGenerator[TokenDelta, None]:
    num_prompt = len(request.prompt_token_ids)
    generated: list[int] = []
    attempt, moves = request, 0
    while True:
        try:
            async with aclosing(dispatcher.execute(placement, attempt)) as deltas:
                async for delta in deltas:
                    generated += delta.token_ids
                    yield _as_original(delta, request.request_id, num_prompt) if moves else delta
            return
        except NodeFailure as exc:
            if not exc.lost:
                raise
            if moves >= dispatcher.config.max_migrations:
                dispatcher.metrics.migration_failures.labels("max_migrations").inc()
                raise
            lost = exc
        moves += 1
        following = continuation(request, generated, moves)
        if following is None:  # the lost node had streamed everything but the finish
            yield _finish(request, generated, num_prompt)
            return
        attempt = following
        placement = await _replace(dispatcher, attempt, lost)
        dispatcher.metrics.migrations.inc()
        logger.warning("request %s: %s; moving it to %s after %d tokens", request.request_id,
                       lost, placement.decision.decode_node, len(generated))


def continuation(request: GenerateRequest, generated: list[int], move: int
                 ) -> GenerateRequest | None:
    """The node request that continues `request` after `generated`; None if nothing is left
    to generate (max_tokens reached, or the last token was a stop token)."""
    sampling = request.sampling
    left = sampling.max_tokens - len(generated)
    if left <= 0 or _stopped(request, generated):
        return None
    sampling = replace(sampling, max_tokens=left,
                       min_tokens=max(0, sampling.min_tokens - len(generated)))
    return replace(request, request_id=f"{request.request_id}-m{move}",
                   prompt_token_ids=request.prompt_token_ids + generated, sampling=sampling,
                   transfer=None, prefix_source=None)


async def _replace(dispatcher: Dispatcher, attempt: GenerateRequest,
                   lost: NodeFailure) -> Placement:
    try:
        return await dispatcher.place(attempt.prompt_token_ids, attempt.cache_salt)
    except NoHealthyNode as exc:
        dispatcher.metrics.migration_failures.labels("no_healthy_node").inc()
        raise NoHealthyNode(f"{lost}, and no other node is healthy") from exc


def _stopped(request: GenerateRequest, generated: list[int]) -> bool:
    sampling = request.sampling
    # the router leaves EOS out of stop_token_ids when the request ignores it
    return (bool(generated) and len(generated) >= sampling.min_tokens
            and generated[-1] in sampling.stop_token_ids)


def _finish(request: GenerateRequest, generated: list[int], num_prompt: int) -> TokenDelta:
    reason = "stop" if _stopped(request, generated) else "length"
    return TokenDelta(request.request_id, [], True, reason, None, num_prompt, 0)


def _as_original(delta: TokenDelta, request_id: str, num_prompt: int) -> TokenDelta:
    """A continuation's delta as the original request's: its id, its prompt (the new node's
    prompt also holds the tokens generated before the move)."""
    return replace(delta, request_id=request_id, num_prompt_tokens=num_prompt,
                   num_cached_tokens=min(delta.num_cached_tokens, num_prompt))
