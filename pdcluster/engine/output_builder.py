"""`OutputBuilder`: a request's state after a step, as the `RequestOutput` the engine returns
(torch-free).

It hands out each token once (`new_token_ids` since the last output), decodes the text when a
request finishes, and applies stop strings: those need the text every step, and the first one
found finishes the request there — cutting a verified run of speculative tokens back to the
token that completed it (engine/spec_decode/stops.py).
"""

from __future__ import annotations

from collections.abc import Callable

from pdcluster.core.types import ReqId
from pdcluster.engine.core.outputs import RequestOutput, StopStringChecker
from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.spec_decode.stops import cut_at_first_stop


class OutputBuilder:
    """`finish(request_id, status)` ends a request that a stop string stopped while it was
    still running (the scheduler's `finish_request`)."""

    def __init__(self, tokenizer, finish: Callable[[ReqId, RequestStatus], object]) -> None:
        self.tokenizer = tokenizer
        self.stops = StopStringChecker(tokenizer)
        self._finish = finish

    def output(self, req: Request, step_s: float) -> RequestOutput:
        text = ""
        if req.params.stop and req.status is not RequestStatus.FINISHED_ERROR:
            text = self._stop_strings(req)
        elif req.is_finished and self.tokenizer is not None and req.params.detokenize:
            text = self.stops.decode(req)
        new_token_ids = req.output_token_ids[req.num_emitted_tokens:]
        req.num_emitted_tokens = req.num_output_tokens
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), new_token_ids=new_token_ids,
            finished=req.is_finished,
            finish_reason=req.status.value if req.is_finished else None,
            stop_reason=req.stop_reason, error=req.error, text=text,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            top_logprobs=list(req.top_logprobs) if req.params.logprobs else None,
            num_cached_tokens=max(req.num_cached_tokens, 0), metrics={"step_s": step_s})

    def error_output(self, req: Request, step_s: float) -> RequestOutput:
        """The output of a request whose output could not be built: finished with its
        error and the tokens it had, no text."""
        new_token_ids = req.output_token_ids[req.num_emitted_tokens:]
        req.num_emitted_tokens = req.num_output_tokens
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=list(req.output_token_ids), new_token_ids=new_token_ids, finished=True,
            finish_reason=RequestStatus.FINISHED_ERROR.value, error=req.error,
            num_cached_tokens=max(req.num_cached_tokens, 0), metrics={"step_s": step_s})

    def _stop_strings(self, req: Request) -> str:
        """Decode, and finish the request at its first stop string — also when the same step
        ended it by length: the stop string wins, as the text was cut there."""
        text = self.stops.decode(req)
        hit = self.stops.find(req, text)
        if hit is None:
            return text
        if req.num_output_tokens - req.num_emitted_tokens > 1:  # a verified run of tokens
            hit = cut_at_first_stop(self.stops, req, req.num_emitted_tokens) or hit
        req.stop_reason, text = hit
        if req.is_finished:
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self._finish(req.request_id, RequestStatus.FINISHED_STOPPED)
        return text
