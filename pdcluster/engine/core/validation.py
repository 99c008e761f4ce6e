"""Request checks that need the engine's knowledge (torch-free): `RequestLimits` — the
vocabulary, the engine's limits and the model's length, fixed when the engine starts — and
`validate_request` and `validate_keys` (the sizes of the request id and cache salt), which
`LLMEngine.add_request` runs before any state changes.
`SamplingParams` checks the rest (types, finite ranges, sizes) at construction. Every failure
is a ValueError whose message names the field; a node server answers it with
`RequestError("invalid_request")` for that request alone."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from pdcluster.engine.core.sampling_params import SamplingParams

# Both travel with every reply or into every block hash: a megabyte salt would make each
# block of the prompt hash a megabyte.
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_logprobs: int
    max_model_len: int
    block_size: int
    num_blocks: int
    has_tokenizer: bool


def validate_request(token_ids: Sequence[int], params: SamplingParams,
                     limits: RequestLimits) -> None:
    if not token_ids:
        raise ValueError("prompt: the prompt is empty")
    check_token_ids("prompt token ids", token_ids, limits.vocab_size)
    if params.stop_token_ids:
        check_token_ids("stop_token_ids", params.stop_token_ids, limits.vocab_size)
    if params.logit_bias:
        check_token_ids("logit_bias", list(params.logit_bias), limits.vocab_size)
    if params.stop and not limits.has_tokenizer:
        raise ValueError("stop strings need a tokenizer, and this model folder has none")
    if params.guided is not None and not limits.has_tokenizer:
        raise ValueError("guided decoding needs a tokenizer, and this model folder has none")
    max_logprobs = min(limits.max_logprobs, limits.vocab_size)
    if params.logprobs is not None and params.logprobs > max_logprobs:
        raise ValueError(f"logprobs must be in [0, {max_logprobs}] on this node, got "
                         f"{params.logprobs}")
    _check_length(len(token_ids), params.max_tokens, limits)


def validate_keys(request_id: str, cache_salt: str | None) -> None:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} "
                         f"characters")
    if cache_salt is not None and (not isinstance(cache_salt, str)
                                   or len(cache_salt) > MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be a string of at most {MAX_CACHE_SALT_CHARS} "
                         f"characters")


def check_token_ids(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Every id an integer in [0, vocab_size), in one C-speed pass (array) rather than a
    Python loop: a float, a bool-like oddity or a 70-bit int fails the conversion."""
    try:
        ids = array("q", token_ids)
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"{name} must be integers in [0, {vocab_size}): {exc}") from None
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} must be in [0, {vocab_size}) (the vocabulary), got ids "
                         f"from {low} to {high}")


def _check_length(num_prompt_tokens: int, max_tokens: int, limits: RequestLimits) -> None:
    total = num_prompt_tokens + max_tokens
    if total > limits.max_model_len:
        raise ValueError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
            f"the maximum model length {limits.max_model_len}")
    # The last sampled token is returned, never fed back: its KV needs no slot.
    if -(-(total - 1) // limits.block_size) > limits.num_blocks:
        raise ValueError(f"this request needs more KV blocks than the cache has "
                         f"({limits.num_blocks})")
