"""`SpecDecoder`: the engine's speculative-decoding step logic (torch-free).

Before each schedule, `propose` asks the proposer for draft tokens for every running request
in decode, capped so that no proposal can pass the request's `max_tokens` or the model
length (a request that can emit one more token gets none). After the step, `record` counts
proposed and accepted tokens (`stats`) and adapts: a request whose proposal was rejected
outright skips proposing for 1, 2, 4 ... up to `_MAX_BACKOFF` steps; an acceptance halves the
back-off. Text that does not repeat thus costs next to nothing over plain decoding.
"""

from __future__ import annotations

from pdcluster.core.types import ReqId
from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.core.sampling_params import SamplingParams
from pdcluster.engine.core.scheduler_output import SchedulerOutput
from pdcluster.engine.spec_decode.config import SpeculativeConfig
from pdcluster.engine.spec_decode.proposer import Proposer
from pdcluster.engine.spec_decode.stats import SpecDecodeStats

_MAX_BACKOFF = 16


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self._backoff: dict[ReqId, int] = {}  # steps to skip after the last full rejection
        self._skip: dict[ReqId, int] = {}  # steps left to skip

    def propose(self, running: list[Request]) -> dict[ReqId, list[int]]:
        """Draft tokens per request id (requests with none are left out)."""
        requests, caps = [], []
        for req in running:
            cap = self._cap(req)
            if cap > 0 and not self._skipping(req.request_id):
                requests.append(req)
                caps.append(cap)
        if not requests:
            return {}
        drafts = self.proposer.propose(requests, caps)
        return {req.request_id: tokens[:cap]
                for req, tokens, cap in zip(requests, drafts, caps, strict=True) if tokens}

    def _cap(self, req: Request) -> int:
        if req.status is not RequestStatus.RUNNING or req.is_prefilling \
                or not verifiable(req.params):
            return 0
        return min(self.config.num_speculative_tokens,
                   req.params.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def _skipping(self, request_id: ReqId) -> bool:
        left = self._skip.get(request_id, 0)
        if left:
            self._skip[request_id] = left - 1
        return left > 0

    def record(self, sched: SchedulerOutput, sampled: list) -> None:
        """Count each verification of `sched` and adapt the back-off of its request."""
        for item, result in zip(sched.scheduled, sampled, strict=True):
            if not item.spec_token_ids or not isinstance(result, list):
                continue
            num_accepted = len(result) - 1
            self.stats.record(len(item.spec_token_ids), num_accepted)
            self._adapt(item.request.request_id, num_accepted)

    def _adapt(self, request_id: ReqId, num_accepted: int) -> None:
        if num_accepted:
            backoff = self._backoff.pop(request_id, 0) // 2
            if backoff:
                self._backoff[request_id] = backoff
            return
        backoff = min(2 * self._backoff.get(request_id, 0) or 1, _MAX_BACKOFF)
        self._backoff[request_id] = self._skip[request_id] = backoff

    def forget(self, request_id: ReqId) -> None:
        self._backoff.pop(request_id, None)
        self._skip.pop(request_id, None)
        self.proposer.forget(request_id)

    def retain(self, request_ids: set[ReqId]) -> None:
        for gone in [r for r in self._backoff if r not in request_ids]:
            self.forget(gone)
        self.proposer.retain(request_ids)


def verifiable(params: SamplingParams) -> bool:
    """Whether verification can judge drafts for these parameters: it re-derives the target's
    distribution from temperature, top-k, top-p and min_tokens only, so a request that shapes
    its logits further (penalties, logit_bias, a grammar) decodes one token per step."""
    return (not params.logit_bias and params.guided is None and params.presence_penalty == 0
            and params.frequency_penalty == 0 and params.repetition_penalty == 1)


def build_proposer(config: SpeculativeConfig, target) -> Proposer:
    """The proposer `config` names; `target` is the `LLMEngine` (the draft model takes its
    device, dtype, block size, pool size and vocabulary from it)."""
    if config.method == "ngram":
        from pdcluster.engine.spec_decode.ngram import NgramProposer

        return NgramProposer(config.ngram_min, config.ngram_max)
    from pdcluster.engine.spec_decode.draft import DraftProposer

    return DraftProposer.for_target(config, target)


__all__ = ["SpecDecoder", "build_proposer"]
