"""The policy for every request parameter of `/v1/completions` and `/v1/chat/completions`, in
one table: each parameter vLLM's OpenAI server (or OpenAI's) accepts on those endpoints
either takes effect (`APPLIED`, parsed by router.api.protocol) or is accepted only at its default
value (`DEFAULT_ONLY`: any other value is refused with a 400 naming it). A parameter not in
the table is refused with a 400 naming it: nothing a client sends is silently ignored
(vLLM logs and drops unknown fields; we do not).

API: `PARAMS`, `Param`, `check_params`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.router.errors import ApiError

APPLIED, DEFAULT_ONLY = "applied", "default_only"
BOTH, COMPLETIONS, CHAT = "both", "completions", "chat"


@dataclass(frozen=True, slots=True)
class Param:
    endpoints: str  # BOTH, COMPLETIONS or CHAT
    policy: str  # APPLIED or DEFAULT_ONLY
    note: str
    default: Any = None  # DEFAULT_ONLY: the one value accepted (null is always accepted)


_A, _D = APPLIED, DEFAULT_ONLY
PARAMS: dict[str, Param] = {
    # --- the request itself
    "model": Param(BOTH, _A, "must name the served model (404 otherwise)"),
    "prompt": Param(COMPLETIONS, _A, "a string or token ids; a batch of one"),
    "messages": Param(CHAT, _A, "rendered with the model's chat template"),
    "stream": Param(BOTH, _A, "SSE chunks"),
    "stream_options": Param(BOTH, _A, "include_usage, continuous_usage_stats"),
    "user": Param(BOTH, _A, "informational: identifies the end user, changes no output"),
    "request_id": Param(BOTH, _A, "becomes the response id"),
    "cache_salt": Param(BOTH, _A, "salts the prefix-cache hashes (tenant isolation)"),
    "priority": Param(BOTH, _D, "no priority scheduling: only 0", 0),
    # --- length
    "max_tokens": Param(BOTH, _A, "checked against the context"),
    "max_completion_tokens": Param(BOTH, _A, "same as max_tokens; both set and different: 400"),
    "min_tokens": Param(BOTH, _A, "EOS and stop_token_ids banned before it (node)"),
    "ignore_eos": Param(BOTH, _A, "EOS does not stop (node)"),
    "stop": Param(BOTH, _A, "stop strings, cut by the router's detokenizer"),
    "stop_token_ids": Param(BOTH, _A, "merged with the model's EOS ids (node)"),
    # --- sampling (node)
    "temperature": Param(BOTH, _A, "0 is greedy"),
    "top_p": Param(BOTH, _A, "nucleus filter"),
    "top_k": Param(BOTH, _A, "-1 or 0 disables it"),
    "seed": Param(BOTH, _A, "per-request generator; choice i > 0 of n uses a derived seed"),
    "presence_penalty": Param(BOTH, _A, "[-2, 2], on the node's sampler"),
    "frequency_penalty": Param(BOTH, _A, "[-2, 2], on the node's sampler"),
    "repetition_penalty": Param(BOTH, _A, "(0, 2], on the node's sampler"),
    "logit_bias": Param(BOTH, _A, "token id (string key) -> bias in [-100, 100]"),
    "min_p": Param(BOTH, _D, "not implemented in the sampler", 0.0),
    "use_beam_search": Param(BOTH, _D, "no beam search", False),
    "length_penalty": Param(BOTH, _D, "beam search only", 1.0),
    "allowed_token_ids": Param(BOTH, _D, "not implemented (use logit_bias or guided_*)"),
    "bad_words": Param(CHAT, _D, "not implemented", []),
    "logits_processors": Param(BOTH, _D, "no custom code on the nodes"),
    # --- choices
    "n": Param(BOTH, _A, "n choices; the prompt is prefilled once (prefix cache)"),
    "best_of": Param(BOTH, _A, ">= n samples, the n of highest cumulative logprob "
                               "returned; not with stream"),
    "echo": Param(BOTH, _A, "completions: the prompt prepended (not with logprobs); "
                            "chat: only false"),
    # --- logprobs
    "logprobs": Param(BOTH, _A, "completions: int k; chat: bool"),
    "top_logprobs": Param(CHAT, _A, "k alternatives per token (needs logprobs=true)"),
    "return_tokens_as_token_ids": Param(BOTH, _A, "logprob tokens as 'token_id:N'"),
    "prompt_logprobs": Param(BOTH, _D, "not computed by the nodes"),
    # --- structured output (node: grammar mask)
    "response_format": Param(BOTH, _A, "text, json_object, json_schema"),
    "guided_json": Param(BOTH, _A, "a JSON schema (object or its text)"),
    "guided_regex": Param(BOTH, _A, "a regular expression"),
    "guided_choice": Param(BOTH, _A, "a list of strings"),
    "guided_grammar": Param(BOTH, _A, "an EBNF grammar"),
    "structured_outputs": Param(BOTH, _A, "{json|regex|choice|grammar|json_object}"),
    "guided_decoding_backend": Param(BOTH, _D, "one backend, chosen by the node"),
    "guided_whitespace_pattern": Param(BOTH, _D, "not configurable"),
    "structural_tag": Param(BOTH, _D, "not implemented"),
    # --- tools (chat)
    "tools": Param(CHAT, _A, "rendered by the chat template, parsed into tool_calls"),
    "tool_choice": Param(CHAT, _A, "none, auto, required, or a named function"),
    "parallel_tool_calls": Param(CHAT, _A, "false keeps only the first call"),
    "reasoning_effort": Param(CHAT, _D, "no reasoning models served"),
    "include_reasoning": Param(CHAT, _D, "no reasoning parser", True),
    # --- prompt rendering
    "add_special_tokens": Param(BOTH, _D, "the endpoint's default only (completions: true, "
                                          "chat: false)"),
    "add_generation_prompt": Param(CHAT, _D, "always added", True),
    "continue_final_message": Param(CHAT, _D, "not implemented", False),
    "chat_template": Param(CHAT, _D, "no per-request templates"),
    "chat_template_kwargs": Param(CHAT, _D, "not implemented"),
    "documents": Param(CHAT, _D, "not implemented"),
    "mm_processor_kwargs": Param(BOTH, _D, "text-only models"),
    "truncate_prompt_tokens": Param(BOTH, _D, "not implemented"),
    "suffix": Param(COMPLETIONS, _D, "no fill-in-the-middle"),
    "prompt_embeds": Param(COMPLETIONS, _D, "token input only"),
    # --- output text
    "skip_special_tokens": Param(BOTH, _D, "special tokens are always skipped", True),
    "spaces_between_special_tokens": Param(BOTH, _D, "not configurable", True),
    "include_stop_str_in_output": Param(BOTH, _D, "stop strings are always cut", False),
    # --- vLLM internals
    "kv_transfer_params": Param(BOTH, _D, "the router does the disaggregation"),
    "vllm_xargs": Param(BOTH, _D, "no custom extensions"),
}
_SPECIAL_TOKENS_DEFAULT = {COMPLETIONS: True, CHAT: False}


def check_params(body: dict, chat: bool) -> None:
    """400 for a parameter not in the table (or not of this endpoint) and for a
    DEFAULT_ONLY parameter set to anything but its default."""
    endpoint = CHAT if chat else COMPLETIONS
    for name, value in body.items():
        param = PARAMS.get(name)
        if param is None or param.endpoints not in (BOTH, endpoint):
            raise ApiError(400, f"unknown parameter '{name}' for /v1/"
                           f"{'chat/completions' if chat else 'completions'}", name,
                           "unknown_parameter")
        if param.policy == DEFAULT_ONLY and value is not None:
            default = (_SPECIAL_TOKENS_DEFAULT[endpoint] if name == "add_special_tokens"
                       else param.default)
            if value != default or isinstance(value, bool) != isinstance(default, bool):
                raise ApiError(400, f"'{name}' is not supported by this server "
                               f"({param.note}); accepted: {default!r} or null", name,
                               "unsupported_parameter")
