"""What the engine returns per request per step, and the text side of stopping.

`RequestOutput.new_token_ids` are the tokens produced by this step (streaming); `token_ids` all
output tokens so far. `text` is decoded when the request finishes, or every step for requests
with stop strings (which need it to stop); other streaming consumers detokenize themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdcluster.core.types import ReqId
from pdcluster.engine.core.request import Request


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """How busy the engine is, for a node's load report: requests waiting to start, requests
    holding blocks (running or waiting for remote KV), free and total KV blocks, and prompt
    tokens still to compute."""

    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_blocks: int
    num_queued_tokens: int


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """A snapshot of the engine's figures for a node's metrics: the gauges of `EngineLoad`
    plus the KV blocks in use and in the prefix cache (a cached block may also be in use),
    and running totals since start — steps and their seconds, preemptions, and, over the
    prompts the engine computes itself (not KV that arrives from a prefill node), the
    prompt tokens looked up in the prefix cache and the tokens it held; with speculative
    decoding on, the draft tokens verified and those accepted (all zero when off)."""

    load: EngineLoad
    num_used_blocks: int
    num_cached_blocks: int
    num_steps: int
    step_seconds: float
    num_preemptions: int
    num_prefix_queried_tokens: int
    num_prefix_hit_tokens: int
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0


@dataclass(slots=True)
class SampledToken:
    """One token drawn by the sampler for one request in one step. `grammar_ended`: the
    request's structured-output grammar is complete with this token, which finishes it."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    grammar_ended: bool = False


@dataclass(slots=True)
class RequestFailure:
    """A per-request stage (sampling, stop checks, output) failed for this request alone: it
    finishes with finish_reason "error" and `error` as the reason; the others go on."""

    error: str


# What the runner returns per scheduled chunk: nothing (no token drawn), one token, the
# tokens of a verified proposal (engine/spec_decode), or this request's failure.
StepResult = SampledToken | list[SampledToken] | RequestFailure | None


@dataclass(slots=True)
class RequestOutput:
    request_id: ReqId
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why a request ended with finish_reason "error"
    text: str = ""
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


class StopStringChecker:
    """Finds the first stop string in a request's decoded output and where to cut the text."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids,
                                     skip_special_tokens=req.params.skip_special_tokens)

    def find(self, req: Request, text: str) -> tuple[str, str] | None:
        """(stop string, truncated text) for the earliest stop string in `text`, else None."""
        best: tuple[int, str] | None = None
        for stop in req.params.stop:
            idx = text.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        cut = idx + len(stop) if req.params.include_stop_str_in_output else idx
        return stop, text[:cut]
