"""OpenAI request bodies -> validated `CompletionRequest`; errors in OpenAI's JSON shape.

`router.api.params.check_params` first refuses unknown parameters and unsupported values (the one
table of the policy); the parsers here read the parameters that take effect. Everything a
client can get wrong raises `router.errors.ApiError` (status 4xx, message, param), which the
server turns into `{"error": {"message", "type", "param", "code"}}`.

API: `CompletionRequest`, `parse_completion`, `parse_chat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pdcluster.core.sampling import SamplingSpec
from pdcluster.router.api.guided import parse_guided
from pdcluster.router.api.messages import parse_message
from pdcluster.router.api.params import check_params
from pdcluster.router.api.tools import ToolChoice, parse_tools
from pdcluster.router.errors import ApiError

_NUMBER = (int, float)
MAX_N = 16  # choices (or best_of samples) per request
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 128


@dataclass(slots=True)
class CompletionRequest:
    """A parsed request. `sampling` holds its sampling fields as the client set them (their
    one declaration is `core.sampling.SamplingSpec`), except `max_tokens`: the client's is
    the field here (None: as many as the context leaves), resolved against the prompt by
    `router.api.request_prep`; `sampling_spec` gives what a node is sent."""

    model: str
    chat: bool
    prompt: str | list[int] | None = None
    messages: list[dict] = field(default_factory=list)
    max_tokens: int | None = None
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    tokens_as_ids: bool = False
    n: int = 1
    best_of: int = 1
    echo: bool = False
    tools: list[dict] = field(default_factory=list)
    tool_choice: ToolChoice | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None

    def sampling_spec(self, max_tokens: int, stop_token_ids: list[int]) -> SamplingSpec:
        """The node's sampling fields: `max_tokens` as resolved against the context, the
        model's end-of-sequence ids (`stop_token_ids`, unless `ignore_eos`) with the
        request's own stop ids. Stop strings stay with the router (its detokenizer ends the
        stream), so the node gets none. best_of > n needs each sample's logprobs to rank."""
        own = self.sampling
        eos = [] if own.ignore_eos else stop_token_ids
        stops = list(dict.fromkeys([*eos, *own.stop_token_ids]))
        logprobs = own.logprobs
        if logprobs is None and self.best_of > self.n:
            logprobs = 0
        return replace(own, max_tokens=max_tokens, stop=[], stop_token_ids=stops,
                       logprobs=logprobs, logit_bias=dict(own.logit_bias))

    def set_sampling(self, **changes: Any) -> None:
        """Set sampling fields by name (the spec is frozen: a new one replaces it)."""
        self.sampling = replace(self.sampling, **changes)


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


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = float(_get(body, name, _NUMBER, default))
    _check_range(name, value, low, high)
    return value


def _common(body: Any, chat: bool) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    check_params(body, chat)
    model = _get(body, "model", str)
    if not model:
        raise ApiError(400, "'model' is required", "model", "missing_required_parameter")
    req = CompletionRequest(model=model, chat=chat)
    _lengths(req, body)
    _sampling(req, body)
    _choices(req, body)
    req.stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, {})
    if options and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true",
                       "stream_options", "invalid_value")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise ApiError(400, f"unknown stream_options {sorted(unknown)}", "stream_options",
                       "unknown_parameter")
    req.include_usage = bool(_get(options, "include_usage", bool, False))
    req.continuous_usage = bool(_get(options, "continuous_usage_stats", bool, False))
    req.user = _get(body, "user", str)
    req.cache_salt = _get(body, "cache_salt", str)
    req.request_id = _get(body, "request_id", str)
    req.tokens_as_ids = _get(body, "return_tokens_as_token_ids", bool, False)
    req.set_sampling(guided=parse_guided(body))
    return req


def _lengths(req: CompletionRequest, body: dict) -> None:
    """max_tokens / max_completion_tokens (the same limit: both set and different is a
    400), min_tokens, stop strings, stop token ids, ignore_eos."""
    max_tokens = _get(body, "max_tokens", int)
    completion = _get(body, "max_completion_tokens", int)
    if max_tokens is not None and completion is not None and max_tokens != completion:
        raise ApiError(400, "set only one of 'max_tokens' and 'max_completion_tokens'",
                       "max_completion_tokens", "invalid_value")
    req.max_tokens = completion if completion is not None else max_tokens
    if req.max_tokens is not None and req.max_tokens < 1:
        name = "max_completion_tokens" if completion is not None else "max_tokens"
        raise ApiError(400, f"'{name}' must be >= 1, got {req.max_tokens}", name,
                       "invalid_value")
    min_tokens = _get(body, "min_tokens", int, 0)
    _check_range("min_tokens", min_tokens, 0, req.max_tokens or (1 << 31))
    stop = _get(body, "stop", (str, list), [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop",
                       "invalid_value")
    stop_token_ids = _get(body, "stop_token_ids", list, [])
    if len(stop_token_ids) > MAX_STOP_TOKEN_IDS or not all(
            _is_token_id(t) for t in stop_token_ids):
        raise ApiError(400, f"'stop_token_ids' must be a list of at most {MAX_STOP_TOKEN_IDS} "
                       "token ids", "stop_token_ids", "invalid_value")
    req.set_sampling(min_tokens=min_tokens, stop=stop, stop_token_ids=stop_token_ids,
                     ignore_eos=_get(body, "ignore_eos", bool, False))


def _sampling(req: CompletionRequest, body: dict) -> None:
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 1e-9, 1.0)
    top_k = _get(body, "top_k", int, 0)
    top_k = 0 if top_k == -1 else top_k
    _check_range("top_k", top_k, 0, 1 << 20)
    seed = _get(body, "seed", int)
    if seed is not None:
        _check_range("seed", seed, -(1 << 63), (1 << 63) - 1)
    req.set_sampling(
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-6, 2.0),
        logit_bias=_logit_bias(_get(body, "logit_bias", dict, {})))


def _logit_bias(raw: dict) -> dict[int, float]:
    """OpenAI's {"token id": bias} with string keys; ids are checked against the
    vocabulary by router.api.request_prep."""
    if len(raw) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"'logit_bias' has more than {MAX_LOGIT_BIAS} entries",
                       "logit_bias", "invalid_value")
    bias = {}
    for key, value in raw.items():
        if not key.isdecimal() or not _is_number(value):
            raise ApiError(400, "'logit_bias' maps token ids (as strings) to numbers, got "
                           f"{key!r}: {value!r}", "logit_bias", "invalid_value")
        _check_range("logit_bias", float(value), -100.0, 100.0)
        bias[int(key)] = float(value)
    return bias


def _choices(req: CompletionRequest, body: dict) -> None:
    """n and best_of (vLLM: best_of >= n samples, the n best returned)."""
    req.n = _get(body, "n", int, 1)
    _check_range("n", req.n, 1, MAX_N)
    req.best_of = _get(body, "best_of", int, req.n)
    _check_range("best_of", req.best_of, req.n, MAX_N)
    if req.best_of > req.n and _get(body, "stream", bool, False):
        raise ApiError(400, "'best_of' > n cannot stream (the best are known at the end)",
                       "best_of", "unsupported_value")


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _is_number(value: object) -> bool:
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def parse_completion(body: Any) -> CompletionRequest:
    req = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and bool(prompt) and all(_is_token_id(t) for t in prompt)
    if (isinstance(prompt, str) and prompt) or is_ids:
        req.prompt = prompt
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids "
                       "(batches of several prompts are not supported)", "prompt",
                       "invalid_value")
    logprobs = _get(body, "logprobs", int)
    if logprobs is not None:
        _check_range("logprobs", logprobs, 0, 20)
        req.set_sampling(logprobs=logprobs)
    req.echo = _get(body, "echo", bool, False)
    if req.echo and req.sampling.logprobs is not None:
        raise ApiError(400, "'echo' with 'logprobs' needs the prompt's logprobs, which the "
                       "nodes do not compute", "echo", "unsupported_value")
    return req


def parse_chat(body: Any) -> CompletionRequest:
    req = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages", "invalid_value")
    req.messages = [parse_message(m, i) for i, m in enumerate(messages)]
    top = _get(body, "top_logprobs", int)
    if _get(body, "logprobs", bool, False):
        _check_range("top_logprobs", top or 0, 0, 20)
        req.set_sampling(logprobs=top or 0)
    elif top:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs",
                       "invalid_value")
    if _get(body, "echo", bool, False):
        raise ApiError(400, "'echo' is not supported on chat completions", "echo",
                       "unsupported_value")
    req.tools, req.tool_choice = parse_tools(body)
    if req.tool_choice is not None and req.tool_choice.guided is not None:
        if req.sampling.guided is not None:
            raise ApiError(400, "tool_choice 'required' or a named function cannot be "
                           "combined with structured output", "tool_choice",
                           "invalid_value")
        req.set_sampling(guided=req.tool_choice.guided)
    return req
