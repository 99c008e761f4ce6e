"""OpenAI request bodies -> validated `CompletionRequest`; errors in OpenAI's JSON shape.

Everything a client can get wrong raises `router.errors.ApiError` (status 4xx, message,
param), which the server turns into `{"error": {"message", "type", "param", "code"}}`.

API: `CompletionRequest`, `parse_completion`, `parse_chat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcluster.core.sampling import SamplingSpec
from pdcluster.router.errors import ApiError

_NUMBER = (int, float)


@dataclass(slots=True)
class CompletionRequest:
    model: str
    chat: bool
    prompt: str | list[int] | None = None
    messages: list[dict] = field(default_factory=list)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None

    def sampling_spec(self, max_tokens: int, stop_token_ids: list[int]) -> SamplingSpec:
        """The node's sampling fields: `max_tokens` as resolved against the context, the
        model's end-of-sequence ids as stop tokens. Stop strings stay with the router (its
        detokenizer ends the stream), so the node gets none."""
        return SamplingSpec(max_tokens=max_tokens, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                            stop_token_ids=stop_token_ids, logprobs=self.logprobs)


def _get(body: dict, name: str, types: type | tuple, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, types) or isinstance(value, bool) and bool not in _tuple(types):
        raise ApiError(400, f"'{name}' has the wrong type ({type(value).__name__})", name,
                       "invalid_type")
    return value


def _tuple(types: type | tuple) -> tuple:
    return types if isinstance(types, tuple) else (types,)


def _check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ApiError(400, f"'{name}' must be in [{low}, {high}], got {value}", name,
                       "invalid_value")


def _common(body: Any, chat: bool) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    model = _get(body, "model", str)
    if not model:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    req = CompletionRequest(model=model, chat=chat)
    max_tokens = _get(body, "max_completion_tokens", int) if chat else None
    req.max_tokens = max_tokens if max_tokens is not None else _get(body, "max_tokens", int)
    if req.max_tokens is not None and req.max_tokens < 1:
        raise ApiError(400, f"'max_tokens' must be >= 1, got {req.max_tokens}", "max_tokens",
                       "invalid_value")
    req.temperature = float(_get(body, "temperature", _NUMBER, 1.0))
    _check_range("temperature", req.temperature, 0.0, 2.0)
    req.top_p = float(_get(body, "top_p", _NUMBER, 1.0))
    _check_range("top_p", req.top_p, 1e-9, 1.0)
    req.top_k = _get(body, "top_k", int, 0)
    req.top_k = 0 if req.top_k == -1 else req.top_k
    _check_range("top_k", req.top_k, 0, 1 << 20)
    req.seed = _get(body, "seed", int)
    if req.seed is not None:
        _check_range("seed", req.seed, -(1 << 63), (1 << 64) - 1)
    n = _get(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", "n", "unsupported_value")
    stop = _get(body, "stop", (str, list), [])
    req.stop = [stop] if isinstance(stop, str) else stop
    if len(req.stop) > 4 or not all(isinstance(s, str) for s in req.stop):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop",
                       "invalid_value")
    req.stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    req.include_usage = bool(_get(options, "include_usage", bool, False))
    req.user = _get(body, "user", str)
    req.cache_salt = _get(body, "cache_salt", str)
    return req


def parse_completion(body: Any) -> CompletionRequest:
    req = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt)
    if (isinstance(prompt, str) and prompt) or is_ids:
        req.prompt = prompt
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids "
                       "(batches of several prompts are not supported)", "prompt",
                       "invalid_value")
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None:
        _check_range("logprobs", logprobs, 0, 20)
        req.logprobs = logprobs
    return req


def parse_chat(body: Any) -> CompletionRequest:
    req = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    if _get(body, "logprobs", bool, False):
        req.logprobs = _get(body, "top_logprobs", int, 0)
        _check_range("top_logprobs", req.logprobs, 0, 20)
    return req


def _message(message: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"{where} must be an object with a string 'role'", where,
                       "invalid_value")
    content = message.get("content")
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}.content: only text parts are supported", where,
                           "invalid_value")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string", where, "invalid_type")
    return {"role": message["role"], "content": content}
