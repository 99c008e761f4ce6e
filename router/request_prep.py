"""What the handlers do to an HTTP request before it reaches the dispatcher: check the API
key (constant time), read the JSON body under a size limit, resolve the prompt (model name,
tokenize or apply the chat template, context and max_tokens checks) and build the node's
`GenerateRequest`. Every client mistake is an `ApiError` (4xx). Nothing here writes into the
parsed `CompletionRequest`: resolved values are returned.

API: `check_auth`, `read_json`, `ResolvedPrompt`, `resolve_prompt`, `make_generate`.
"""

from __future__ import annotations

import hmac
import json
import uuid
from dataclasses import dataclass

from aiohttp import web

from pdcluster.core.node_wire import GenerateRequest
from pdcluster.router.errors import ApiError
from pdcluster.router.protocol import CompletionRequest
from pdcluster.router.tokenizer import RouterTokenizer

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True, slots=True)
class ResolvedPrompt:
    """A request's prompt token ids and the number of tokens it may generate."""

    token_ids: list[int]
    max_tokens: int


def check_auth(request: web.Request, keys: list[bytes]) -> None:
    if not keys:
        return
    header = request.headers.get("Authorization", "")
    given = header[7:].encode() if header.startswith("Bearer ") else b""
    if not any(hmac.compare_digest(given, key) for key in keys):
        raise ApiError(401, "invalid or missing API key", None, "invalid_api_key",
                       "authentication_error")


async def read_json(request: web.Request, limit: int) -> object:
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


def resolve_prompt(req: CompletionRequest, tokenizer: RouterTokenizer, model_name: str,
                   max_tokens_limit: int) -> ResolvedPrompt:
    if req.model != model_name:
        raise ApiError(404, f"the model '{req.model}' does not exist", "model",
                       "model_not_found")
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
    return ResolvedPrompt(ids, max_tokens)


def _tokenize(req: CompletionRequest, tokenizer: RouterTokenizer) -> list[int]:
    try:
        if req.chat:
            return tokenizer.apply_chat_template(req.messages)
        if isinstance(req.prompt, str):
            return tokenizer.encode(req.prompt)
        return list(req.prompt or [])
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages" if req.chat else "prompt") from None


def make_generate(req: CompletionRequest, prompt: ResolvedPrompt,
                  eos_token_ids: list[int]) -> GenerateRequest:
    spec = req.sampling_spec(prompt.max_tokens, eos_token_ids)
    return GenerateRequest(uuid.uuid4().hex, prompt.token_ids, spec, None, req.cache_salt)
