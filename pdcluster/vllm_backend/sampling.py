"""The wire's `SamplingSpec` as vLLM's `SamplingParams`, and vLLM's outputs as the node's
`RequestOutput`s. Every field of the spec maps to one of vLLM's own options (structured
output through its `StructuredOutputsParams`, logprobs through its sampler), so nothing a
client asks for is dropped on this path.

Outputs come back as deltas (`RequestOutputKind.DELTA`): each carries only the new tokens,
which is what the node streams. Text is the router's business: vLLM detokenizes only when the
request has stop strings, which it needs the text for.
"""

from __future__ import annotations

import json
from typing import Any

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput as VllmOutput
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from pdcluster.core.sampling import GuidedDecoding, SamplingSpec
from pdcluster.engine.core.outputs import RequestOutput

# vLLM's finish reasons are the node's ("stop", "length", "abort", "error").
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


def to_vllm_params(spec: SamplingSpec, kv_transfer_params: dict[str, Any] | None,
                   max_logprobs: int) -> SamplingParams:
    """vLLM's params for `spec`; ValueError (vLLM's own checks) for values it refuses."""
    if spec.logprobs is not None and spec.logprobs > max_logprobs:
        raise ValueError(f"logprobs={spec.logprobs} exceeds this node's limit of {max_logprobs}")
    extra_args = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    try:
        return _params(spec, extra_args)
    except VLLMValidationError as exc:  # not a ValueError: the node refuses it as one
        raise ValueError(str(exc)) from exc


def _params(spec: SamplingSpec, extra_args: dict[str, Any] | None) -> SamplingParams:
    return SamplingParams(
        n=1, max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed,
        stop=list(spec.stop) or None, stop_token_ids=list(spec.stop_token_ids) or None,
        ignore_eos=spec.ignore_eos, logprobs=spec.logprobs,
        presence_penalty=spec.presence_penalty, frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty, logit_bias=dict(spec.logit_bias) or None,
        structured_outputs=_structured(spec.guided),
        # The router cuts stop strings from the text itself; vLLM must see them to stop.
        detokenize=bool(spec.stop), include_stop_str_in_output=False,
        output_kind=RequestOutputKind.DELTA, extra_args=extra_args)


def _structured(guided: GuidedDecoding | None) -> StructuredOutputsParams | None:
    if guided is None:
        return None
    if guided.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if guided.kind == "json_schema":
        return StructuredOutputsParams(json=guided.spec)
    if guided.kind == "regex":
        return StructuredOutputsParams(regex=guided.spec)
    if guided.kind == "choice":
        choices = json.loads(guided.spec)
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("a choice constraint must be a JSON list of strings")
        return StructuredOutputsParams(choice=choices)
    if guided.kind == "grammar":
        return StructuredOutputsParams(grammar=guided.spec)
    raise ValueError(f"unknown structured-output kind {guided.kind!r}")


def to_node_output(out: VllmOutput, num_top: int, error: str | None = None) -> RequestOutput:
    """One vLLM delta as the node's output (prompt and token lists hold this step's tokens
    only: the node streams deltas and keeps no history). `num_top`: the request's `logprobs`
    (how many alternatives it asked for)."""
    completion = out.outputs[0] if out.outputs else None
    new_ids = list(completion.token_ids) if completion is not None else []
    finish = completion.finish_reason if completion is not None else None
    logprobs, top = _logprobs(completion, new_ids, num_top)
    reason = "error" if error else _FINISH_REASONS.get(finish) if finish else None
    return RequestOutput(
        request_id=out.request_id, prompt_token_ids=[], token_ids=new_ids,
        new_token_ids=new_ids, finished=out.finished or error is not None,
        finish_reason=reason if out.finished or error else None,
        stop_reason=completion.stop_reason if completion is not None else None,
        error=error, logprobs=logprobs, top_logprobs=top,
        num_cached_tokens=out.num_cached_tokens or 0)


def _logprobs(completion, new_ids: list[int], num_top: int
              ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """The chosen tokens' logprobs and the `num_top` best alternatives by rank, per new
    token. vLLM's entry for a position holds the sampled token (at its own rank) and the
    top k; the sampled one counts among the alternatives only when it is in the top k."""
    if completion is None or completion.logprobs is None:
        return None, None
    chosen: list[float] = []
    top: list[list[tuple[int, float]]] = []
    for token_id, position in zip(new_ids, completion.logprobs, strict=False):
        entries = dict(position.items())
        chosen.append(float(entries[token_id].logprob))
        ranked = sorted((lp.rank, tid, float(lp.logprob)) for tid, lp in entries.items()
                        if lp.rank is not None and lp.rank <= num_top)
        top.append([(tid, value) for _, tid, value in ranked])
    return chosen, top
