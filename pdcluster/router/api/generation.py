"""One generation request after its prompt is resolved: place it, run its samples
(router.api.fanout), and answer with one JSON body or a stream of SSE chunks.

The stream is prepared only when the first tokens arrive, so a node that refuses still
yields a proper JSON error status. Chunks of the n choices interleave, each with its `index`;
a chat choice's first chunk carries the role. With tools on (chat, tool_choice not "none"),
content streams up to where a tool call could begin; the calls go out as one `tool_calls`
delta when the choice finishes (or the held text as content if it is no call). A stop
string ends its choice (that sample is aborted); leaving the run aborts the rest. best_of > n
never streams (router.api.protocol refuses it).

API: `Generation`, `EndedWithError`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from pdcluster.router.api.detokenizer import IncrementalDetokenizer
from pdcluster.router.api.fanout import SampleRun
from pdcluster.router.api.protocol import CompletionRequest
from pdcluster.router.api.request_prep import ResolvedPrompt, make_samples
from pdcluster.router.api.responses import (
    Choice,
    chat_logprobs,
    chunk,
    completion_logprobs,
    message,
    now_s,
    rank_best,
    usage,
)
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.api.tools import streamable_prefix, tool_format
from pdcluster.router.errors import NodeFailure, NoHealthyNode, api_error, error_body
from pdcluster.router.metrics import RouterMetrics
from pdcluster.router.routing.dispatch import Dispatcher, Placement


class EndedWithError(Exception):
    """A stream that had started ended with an error event (sent already)."""

    def __init__(self, response: web.StreamResponse, status: int) -> None:
        super().__init__(status)
        self.response, self.status = response, status


@dataclass(slots=True)
class _Streamed:
    """What a choice has sent so far in a stream."""

    num_tokens: int = 0  # tokens whose logprobs went out
    text_offset: int = 0  # completions: the text offset of the next token (logprobs)
    num_chars: int = 0  # chat with tools: characters of the text sent as content
    started: bool = False


class Generation:
    def __init__(self, req: CompletionRequest, prompt: ResolvedPrompt, model: str,
                 tokenizer: RouterTokenizer, metrics: RouterMetrics,
                 on_first_token: Callable[[float], None] | None = None) -> None:
        self.req, self.prompt, self.model = req, prompt, model
        self.on_first_token = on_first_token  # called with the TTFT (admission's check)
        self.tokenizer, self.metrics = tokenizer, metrics
        prefix = "chatcmpl-" if req.chat else "cmpl-"
        self.response_id = prefix + (req.request_id or uuid.uuid4().hex)
        self.samples = make_samples(req, prompt, list(tokenizer.eos_token_ids))
        self.choices = [Choice(IncrementalDetokenizer(tokenizer, req.sampling.stop))
                        for _ in self.samples]
        self.tool_format = tool_format(tokenizer.template_source)
        self.started = time.perf_counter()
        self._last = self.started
        self._first = True

    # ---- running -----------------------------------------------------------------------

    async def respond(self, request: web.Request, dispatcher: Dispatcher,
                      placement: Placement) -> web.StreamResponse:
        async with SampleRun(dispatcher, placement, self.samples) as run:
            if self.req.stream:
                return await self._stream(request, run)
            async for index, delta in run.deltas():
                if self._absorb(run, index, delta) is not None and self._all_done():
                    break
        self.metrics.e2e.observe(time.perf_counter() - self.started)
        return web.json_response(self._body())

    def _absorb(self, run: SampleRun, index: int, delta) -> str | None:
        """Feed one delta to its choice: the new text, or None for a choice already done."""
        choice = self.choices[index]
        if choice.finish_reason is not None:
            return None
        now = time.perf_counter()
        if self._first:
            self.metrics.ttft.observe(now - self.started)
            self._first = False
            if self.on_first_token is not None:
                self.on_first_token(now - self.started)
        self.metrics.output_tokens.inc(len(delta.token_ids))
        if not choice.token_ids:
            self.metrics.node_prompt_tokens.inc(delta.num_prompt_tokens)
            self.metrics.node_cached_tokens.inc(delta.num_cached_tokens)
        text = choice.absorb(delta)
        if choice.detok.stopped:
            run.close_sample(index)
        return text

    def _all_done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    # ---- one body ----------------------------------------------------------------------

    def _body(self) -> dict:
        req = self.req
        chosen = self.choices if req.best_of == req.n else rank_best(self.choices, req.n)
        body_choices = [self._final_choice(i, c) for i, c in enumerate(chosen)]
        return {"id": self.response_id,
                "object": "chat.completion" if req.chat else "text_completion",
                "created": now_s(), "model": self.model, "choices": body_choices,
                "usage": usage(len(self.prompt.token_ids), self.choices)}

    def _final_choice(self, index: int, choice: Choice) -> dict:
        req, end = self.req, len(choice.token_ids)
        if req.chat:
            msg, finish = message(choice, req.tool_choice, self.tool_format)
            logprobs = (chat_logprobs(self.tokenizer, choice, 0, end, req.tokens_as_ids)
                        if req.sampling.logprobs is not None else None)
            return {"index": index, "message": msg, "logprobs": logprobs,
                    "finish_reason": finish}
        logprobs = (completion_logprobs(self.tokenizer, choice, 0, end, 0, req.tokens_as_ids)
                    if req.sampling.logprobs is not None else None)
        return {"index": index, "text": self.prompt.text + choice.text, "logprobs": logprobs,
                "finish_reason": choice.finish_reason}

    # ---- a stream ----------------------------------------------------------------------

    async def _stream(self, request: web.Request, run: SampleRun) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        streamed = [_Streamed() for _ in self.choices]
        try:
            async for index, delta in run.deltas():
                text = self._absorb(run, index, delta)
                if text is None:
                    continue
                if response is None:
                    response = await _prepare(request)
                else:
                    self.metrics.itl.observe(time.perf_counter() - self._last)
                self._last = time.perf_counter()
                for payload in self._chunk_choices(index, text, streamed[index]):
                    await _send(response, self._chunk([payload]))
                if self._all_done():
                    break
            if response is None:
                raise NodeFailure("internal", "the node ended the stream without a token")
        except (NoHealthyNode, NodeFailure) as exc:
            if response is None:
                raise
            await _end_with_error(response, exc)
        if self.req.include_usage:
            await _send(response, {**self._chunk([]), "usage": self._usage()})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.metrics.e2e.observe(time.perf_counter() - self.started)
        return response

    def _chunk(self, choices: list[dict]) -> dict:
        payload = chunk(self.response_id, self.model, self.req.chat, choices)
        if self.req.continuous_usage and choices:
            payload["usage"] = self._usage()
        return payload

    def _usage(self) -> dict:
        return usage(len(self.prompt.token_ids), self.choices)

    def _chunk_choices(self, index: int, text: str, sent: _Streamed) -> list[dict]:
        """The chunk payloads for choice `index` after a delta (none if nothing to say)."""
        req, choice = self.req, self.choices[index]
        out = []
        if req.chat and not sent.started:
            out.append({"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None})
        if not sent.started:
            text = self.prompt.text + text  # echo: the prompt leads the first chunk
        sent.started = True
        holding = req.chat and req.tool_choice is not None and req.tool_choice.mode != "none"
        if holding:
            return out + self._held_chat_choice(index, choice, sent)
        start, end = sent.num_tokens, len(choice.token_ids)
        if not text and choice.finish_reason is None and (req.sampling.logprobs is None
                                                          or start == end):
            return out
        sent.num_tokens = end
        if req.chat:
            logprobs = (chat_logprobs(self.tokenizer, choice, start, end, req.tokens_as_ids)
                        if req.sampling.logprobs is not None else None)
            out.append({"index": index, "delta": {"content": text}, "logprobs": logprobs,
                        "finish_reason": choice.finish_reason})
            return out
        logprobs = None
        if req.sampling.logprobs is not None:
            logprobs = completion_logprobs(self.tokenizer, choice, start, end,
                                           sent.text_offset, req.tokens_as_ids)
            sent.text_offset += sum(len(t) for t in logprobs["tokens"])
        out.append({"index": index, "text": text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason})
        return out

    def _held_chat_choice(self, index: int, choice: Choice, sent: _Streamed) -> list[dict]:
        """Tools on: content streams up to where a call could begin
        (`tools.streamable_prefix`); once the choice finishes, its calls go out as one
        `tool_calls` delta, or the held text as content if it is no call."""
        tools, req = self.req.tool_choice, self.req
        assert tools is not None, "only a chat with a tool choice holds its text"
        end = len(choice.token_ids)
        logprobs = (chat_logprobs(self.tokenizer, choice, sent.num_tokens, end,
                                  req.tokens_as_ids) if req.sampling.logprobs is not None else None)
        if choice.finish_reason is None:
            upto = streamable_prefix(choice.text, tools, self.tool_format)
            if upto <= sent.num_chars:
                return []
            text, sent.num_chars, sent.num_tokens = choice.text[sent.num_chars:upto], upto, end
            return [{"index": index, "delta": {"content": text}, "logprobs": logprobs,
                     "finish_reason": None}]
        msg, finish = message(choice, tools, self.tool_format)
        sent.num_tokens = end
        if "tool_calls" not in msg:
            delta: dict = {"content": choice.text[sent.num_chars:]}
        else:  # the content before the calls, if some of it is still held
            upto = streamable_prefix(choice.text, tools, self.tool_format)
            delta = {"content": choice.text[sent.num_chars:upto] or None,
                     "tool_calls": [{"index": k, **call}
                                    for k, call in enumerate(msg["tool_calls"])]}
        return [{"index": index, "delta": delta, "logprobs": logprobs,
                 "finish_reason": finish}]


async def _prepare(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _end_with_error(response: web.StreamResponse,
                          exc: NoHealthyNode | NodeFailure) -> None:
    error = api_error(exc)
    await _send(response, error_body(error))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    raise EndedWithError(response, error.status) from exc


async def _send(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
