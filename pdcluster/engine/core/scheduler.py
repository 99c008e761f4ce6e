"""Continuous-batching scheduler with chunked prefill and preemption (torch-free).

Each step has a token budget (`max_num_batched_tokens`) and a cap on running requests.
Algorithm, per step:
1. Running requests, decodes first, then unfinished prefills, each in arrival order. A request
   gets `min(tokens left to compute, budget left)` tokens, so a long prompt is split into
   chunks across steps (chunks may end mid-block). If its blocks cannot be allocated, the
   latest-arrived running request not yet scheduled this step is preempted (blocks freed,
   progress reset: it will be recomputed, largely from the prefix cache) until allocation
   succeeds or the request itself is the one preempted.
2. Waiting requests in FCFS order (preempted ones go back to the front), each starting from
   its longest prefix-cache hit, while budget, sequence slots and blocks last. FCFS is strict:
   a request that does not fit blocks the ones behind it. Nothing is admitted in a step that
   had to preempt. A request whose KV comes from another node (a prefill node's transfer or
   a prefix pull) is parked instead, without using the budget.
A step of decodes only can also tell the step after it (`next_decodes`, which allocates its
slots): the model runner launches that one early (engine/runner/lookahead.py), and while it is
in flight `schedule(only=...)` keeps to its requests.
`update_from_output` advances progress, appends sampled tokens for requests whose scheduled
chunk reached their last token, applies stop conditions and frees finished requests.

Where requests wait, how they finish and how KV from other nodes reaches them (the KV
connector's results, pinned blocks, the pin budget, prefix pulls) is `RequestQueues`
(engine/core/request_queues.py), which `Scheduler` extends.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from pdcluster.core.kv_transfer import RemoteDecode
from pdcluster.core.types import ReqId
from pdcluster.engine.core.outputs import RequestFailure, SampledToken, StepResult
from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.core.request_queues import RequestQueues
from pdcluster.engine.core.scheduler_output import (
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class Scheduler(RequestQueues):
    def schedule(self, spec_tokens: Mapping[ReqId, list[int]] | None = None,
                 only: Collection[ReqId] | None = None) -> SchedulerOutput:
        """`spec_tokens`: proposed tokens per request in decode (engine/spec_decode); each
        request's are scheduled after its last token as far as budget and blocks allow.
        `only`: the requests of a decode step already launched (engine/runner/lookahead.py);
        this step schedules none but those, and the others join the next one. When none of
        them is running any more, it is ignored."""
        if only is not None and not any(r.request_id in only for r in self.running):
            only = None
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens,
                                        spec_tokens or {}, only)
        if not out.preempted and only is None:
            self._schedule_waiting(out, budget)
        return out

    def next_decodes(self, out: SchedulerOutput) -> list[ScheduledRequest] | None:
        """The step that will follow `out`, a step of decodes only, when it can be told now:
        each of its requests one position on, less those whose token from `out` ends them by
        length, with the slot of that position allocated. None when it cannot be told
        (something waits to join, a request is left out, blocks are short, a prefill node's
        request whose blocks a transfer reads) or nothing would follow."""
        if out.preempted or self.waiting or len(out.scheduled) != len(self.running):
            return None
        following = []
        for item in out.scheduled:
            req = item.request
            if item.num_tokens != 1 or not item.samples or item.spec_token_ids \
                    or isinstance(req.kv_transfer, RemoteDecode):
                return None
            if req.num_output_tokens + 1 >= req.params.max_tokens \
                    or req.num_tokens + 1 >= self.config.max_model_len:
                continue  # its next token ends it
            if self.kv.allocate_slots(req, 2) is None:  # this step's token and the next
                return None
            following.append(ScheduledRequest(req, item.start + 1, 1,
                                              self.kv.block_ids(req.request_id)))
        return following or None

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          spec_tokens: Mapping[ReqId, list[int]],
                          only: Collection[ReqId] | None) -> int:
        scheduled_ids: set[ReqId] = set()
        for req in sorted(self.running, key=lambda r: (r.is_prefilling, r.arrival_time)):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if only is not None and req.request_id not in only:
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts = self._fitting_drafts(req, spec_tokens.get(req.request_id), budget)
            if not drafts and not self._allocate_or_preempt(req, num_new, scheduled_ids, out):
                continue
            scheduled_ids.add(req.request_id)
            out.scheduled.append(self._scheduled(req, num_new + len(drafts)))
            out.scheduled[-1].spec_token_ids = drafts
            budget -= num_new + len(drafts)
        return budget

    def _fitting_drafts(self, req: Request, drafts: list[int] | None, budget: int) -> list[int]:
        """The proposed tokens that fit the budget and the model length, with their slots
        allocated; none (nothing allocated) for a request not in decode or when blocks are
        short: speculation never preempts."""
        if not drafts or req.is_prefilling:
            return []
        drafts = drafts[:min(budget - 1, self.config.max_model_len - req.num_tokens)]
        if drafts and self.kv.allocate_slots(req, 1 + len(drafts)) is None:
            return []
        return drafts

    def _allocate_or_preempt(self, req: Request, num_new: int, scheduled_ids: set[ReqId],
                             out: SchedulerOutput) -> bool:
        while self.kv.allocate_slots(req, num_new) is None:
            victim = self._pick_victim(scheduled_ids) or req
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _pick_victim(self, scheduled_ids: set[ReqId]) -> Request | None:
        candidates = [r for r in self.running if r.request_id not in scheduled_ids]
        return max(candidates, key=lambda r: r.arrival_time, default=None)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_external = (self._num_external_tokens(req, num_hit_tokens)
                            or self.pulls.num_pull_tokens(req, len(hit_blocks)))
            if num_external:
                if not self._park_for_remote_kv(req, hit_blocks, num_hit_tokens, num_external):
                    break
                continue
            if budget == 0:
                break
            num_new = min(req.num_tokens - num_hit_tokens, budget)
            if self.kv.allocate_slots(req, num_new, hit_blocks) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit_tokens
            if req.num_cached_tokens < 0:
                self._count_prefix_hit(req, num_hit_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, num_new))
            budget -= num_new

    def _scheduled(self, req: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(req, req.num_computed_tokens, num_new,
                                self.kv.block_ids(req.request_id))

    def update_from_output(self, out: SchedulerOutput,
                           sampled: list[StepResult]) -> list[Request]:
        """Apply one step's results; returns the requests that produced a token or finished.
        A request whose sampling failed, or whose token cannot be applied, fails alone. A
        list of tokens is a verified proposal (engine/spec_decode): its accepted tokens and
        the one drawn after them."""
        updated = []
        for item, token in zip(out.scheduled, sampled, strict=True):
            req = item.request
            if req.is_finished:
                continue  # aborted while the step ran
            req.num_computed_tokens = item.start + item.num_tokens
            if token is None:
                continue
            if isinstance(token, RequestFailure):
                self.fail_request(req, token.error)
            elif isinstance(token, list):
                self._apply_verified(req, item.start, token)
            else:
                self._apply_token(req, token)
            updated.append(req)
        return updated

    def _apply_verified(self, req: Request, start: int, tokens: list[SampledToken]) -> None:
        """Append verified tokens one by one with the stop rules of single tokens, so a
        request stops exactly where it would have; only accepted tokens' KV counts as
        computed, blocks they complete are cached and blocks holding only rejected
        proposals are freed."""
        status = None
        num_applied = 0
        try:
            for token in tokens:
                req.append_output_token(token.token_id, token.logprob, token.top_logprobs)
                num_applied += 1
                status = self._check_stop(req)
                if status is not None:
                    break
        except Exception:
            logger.exception("applying tokens to request %s failed", req.request_id)
            status, req.error = RequestStatus.FINISHED_ERROR, "stop checking failed on the node"
        # Positions start .. start + accepted hold the right KV; the last token is new.
        req.num_computed_tokens = start + 1 + min(num_applied, len(tokens) - 1)
        self.kv.cache_blocks(req, req.num_computed_tokens)
        self.kv.trim(req, req.num_tokens)
        if status is not None:
            self.finish_request(req.request_id, status)

    def _apply_token(self, req: Request, token: SampledToken) -> None:
        try:
            req.append_output_token(token.token_id, token.logprob, token.top_logprobs)
            status = self._check_stop(req)
            if token.grammar_ended:  # structured output: nothing may follow
                status = RequestStatus.FINISHED_STOPPED
        except Exception:
            logger.exception("applying a token to request %s failed", req.request_id)
            self.fail_request(req, "stop checking failed on the node")
            return
        if status is not None:
            self.finish_request(req.request_id, status)


__all__ = ["ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
