"""What the handlers do to an HTTP request before it reaches the dispatcher: check the API
key (constant time), read the JSON body (whole, under a size limit and a timeout), resolve
the prompt (model name, tokenize or apply the chat template, context and max_tokens checks)
and build the node's `GenerateRequest`. Every client mistake is an `ApiError` (4xx).
Nothing here writes into the parsed `CompletionRequest`: resolved values are returned.

API: `read_json`, `parse_json`, `ResolvedPrompt`, `resolve_prompt`, `make_generate`,
`make_samples`, `sample_seed`.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, replace

from aiohttp import web

from pdcluster.core import tracing
from pdcluster.core.node_wire import GenerateRequest
from pdcluster.router.api.edge import find_invalid_unicode, read_body
from pdcluster.router.api.protocol import CompletionRequest
from pdcluster.router.api.tokenizer import RouterTokenizer
from pdcluster.router.api.tools import tools_prompt_messages
from pdcluster.router.errors import ApiError

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class ResolvedPrompt:
    """A request's prompt token ids and the number of tokens it may generate."""

    token_ids: list[int]
    max_tokens: int
    text: str = ""  # the prompt as text, for `echo` (completions only)


async def read_json(request: web.Request, limit: int, timeout_s: float) -> object:
    """The request body parsed as JSON (router.api.edge.read_body: whole, under `limit` bytes
    and `timeout_s`); 400 if it is not UTF-8, not JSON, or holds a string that is not
    valid Unicode (naming that field)."""
    return parse_json(await read_body(request, limit, timeout_s))


def parse_json(raw: bytes) -> object:
    """`read_json`'s parsing and checks, for a body already read (any thread)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", None,
                       "invalid_encoding") from None
    except (json.JSONDecodeError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON", None,
                       "invalid_json") from None
    where = find_invalid_unicode(body)
    if where is not None:
        raise ApiError(400, f"'{where}' is not valid Unicode (a lone surrogate)", where,
                       "invalid_unicode")
    return body


def resolve_prompt(req: CompletionRequest, tokenizer: RouterTokenizer, model_name: str,
                   max_tokens_limit: int) -> ResolvedPrompt:
    if req.model != model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist", "model",
                       "model_not_found")
    _check_token_ids(req, tokenizer.vocab_size)
    ids = _tokenize(req, tokenizer)
    context = tokenizer.max_model_len
    if not ids:
        raise ApiError(400, "the prompt is empty after tokenization", "prompt")
    if len(ids) >= context:
        raise ApiError(400, f"this model's maximum context length is {context} tokens; "
                       f"the prompt has {len(ids)}", "messages" if req.chat else "prompt",
                       "context_length_exceeded")
    room = context - len(ids)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = min(room, max_tokens_limit if req.chat else _DEFAULT_COMPLETION_TOKENS)
    if max_tokens > min(room, max_tokens_limit):
        raise ApiError(400, f"max_tokens={max_tokens} is too large: the prompt has "
                       f"{len(ids)} tokens and the context is {context} (limit "
                       f"{max_tokens_limit})", "max_tokens", "context_length_exceeded")
    min_tokens = req.sampling.min_tokens
    if min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens={min_tokens} is above max_tokens={max_tokens}",
                       "min_tokens", "invalid_value")
    text = ""
    if req.echo:
        text = req.prompt if isinstance(req.prompt, str) else tokenizer.decode(ids)
    return ResolvedPrompt(ids, max_tokens, text)


def _check_token_ids(req: CompletionRequest, vocab_size: int) -> None:
    """Token ids a client names must be in the vocabulary."""
    sampling = req.sampling
    for name, ids in (("logit_bias", sampling.logit_bias),
                      ("stop_token_ids", sampling.stop_token_ids)):
        bad = [i for i in ids if i >= vocab_size]
        if bad:
            raise ApiError(400, f"'{name}' names token id {bad[0]}, outside the vocabulary "
                           f"of {vocab_size}", name, "invalid_value")


def _tokenize(req: CompletionRequest, tokenizer: RouterTokenizer) -> list[int]:
    try:
        if req.chat:
            return _render_chat(req, tokenizer)
        if isinstance(req.prompt, str):
            return tokenizer.encode(req.prompt)
        return list(req.prompt or [])
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages" if req.chat else "prompt") from None


def _render_chat(req: CompletionRequest, tokenizer: RouterTokenizer) -> list[int]:
    """The chat with its tools: through the template when it renders them, else in a
    system prompt (router.api.tools); tool_choice "none" renders none."""
    choice = req.tool_choice
    if not req.tools or choice is None or choice.mode == "none":
        return tokenizer.apply_chat_template(req.messages)
    if tokenizer.template_uses_tools:
        return tokenizer.apply_chat_template(req.messages, tools=req.tools)
    return tokenizer.apply_chat_template(tools_prompt_messages(req.messages, req.tools))


def make_generate(req: CompletionRequest, prompt: ResolvedPrompt,
                  eos_token_ids: list[int]) -> GenerateRequest:
    spec = req.sampling_spec(prompt.max_tokens, eos_token_ids)
    # the nodes' spans join the trace of the router's span current here (core.tracing)
    return GenerateRequest(uuid.uuid4().hex, prompt.token_ids, spec, None, req.cache_salt,
                           traceparent=tracing.traceparent())


def make_samples(req: CompletionRequest, prompt: ResolvedPrompt,
                 eos_token_ids: list[int]) -> list[GenerateRequest]:
    """One node request per sample (best_of of them, >= n): the same prompt and cache salt
    (so samples after the first hit the prefix cache), fresh ids, and with a seed, a derived
    seed per sample (`sample_seed`): reproducible and, when sampling, distinct."""
    first = make_generate(req, prompt, eos_token_ids)
    samples = [first]
    for i in range(1, req.best_of):
        own = req.sampling.seed
        seed = None if own is None else sample_seed(own, i)
        samples.append(replace(first, request_id=uuid.uuid4().hex,
                               sampling=replace(first.sampling, seed=seed)))
    return samples


def sample_seed(seed: int, index: int) -> int:
    """Sample `index`'s seed: the request's own for 0, else a hash of both (63 bits)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1
