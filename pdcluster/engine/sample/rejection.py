"""Verification of proposed tokens against the target model's logits (torch).

A chunk `[last token, d_1 .. d_s]` yields s + 1 rows of logits; row j is the target's
distribution p_j for the token after d_j (after the last token for j = 0), processed as the
sampler does for that position (min_tokens bans, temperature, top-k, top-p).
- Greedy: accept the longest prefix of the d_j equal to the target's argmax, then emit the
  target's own argmax at the first mismatch (or after the last draft): the tokens plain
  greedy decoding would have produced.
- Sampling (Leviathan et al., 2023): accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
  at the first rejection draw from norm(max(0, p_j - q_j)) and stop; if all are accepted draw
  one more token from p_s. For point-mass proposals (n-gram, greedy draft) q_j is one-hot, so
  d_j is accepted with probability p_j(d_j) and a rejection draws from p_j without d_j. The
  emitted tokens are distributed exactly as sampling from the target one at a time.
Logprobs are the model's own (raw logits), as the sampler reports them. A request whose
verification raises fails alone (`RequestFailure`), as in the sampler.
"""

from __future__ import annotations

import logging

import torch

from pdcluster.engine.core.outputs import RequestFailure, SampledToken
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.scheduler_output import ScheduledRequest
from pdcluster.engine.sample.draw import filter_logits
from pdcluster.engine.sample.sampler import Sampler

logger = logging.getLogger(__name__)


def verify_chunks(sampler: Sampler, logits: torch.Tensor, items: list[ScheduledRequest]
                  ) -> list[list[SampledToken] | RequestFailure]:
    """Accepted tokens (+ one drawn token) per verifying chunk; `logits` holds each chunk's
    `len(spec_token_ids) + 1` rows in turn (from its last known token on)."""
    results: list[list[SampledToken] | RequestFailure] = []
    offset = 0
    for item in items:
        num_rows = len(item.spec_token_ids) + 1
        results.append(_verify_guarded(sampler, logits[offset:offset + num_rows], item))
        offset += num_rows
    return results


def _verify_guarded(sampler: Sampler, logits: torch.Tensor, item: ScheduledRequest
                    ) -> list[SampledToken] | RequestFailure:
    try:
        return verify(sampler, logits, item.request, item.spec_token_ids)
    except Exception:
        logger.exception("verifying proposed tokens failed for request %s",
                         item.request.request_id)
        return RequestFailure("sampling failed on the node")


def verify(sampler: Sampler, logits: torch.Tensor, req: Request, drafts: list[int],
           draft_probs: torch.Tensor | None = None) -> list[SampledToken]:
    """logits: [len(drafts) + 1, vocab] (modified in place); draft_probs: [len(drafts),
    vocab] or None for point masses. Returns the accepted drafts and one target token."""
    p = req.params
    logprobs = torch.log_softmax(logits, dim=-1) if p.logprobs is not None else None
    _ban_early_stop(logits, req)
    if p.is_greedy:
        tokens = accept_greedy(drafts, logits.argmax(dim=-1).tolist())
    else:
        probs = target_probs(logits, req)
        tokens = rejection_sample(probs, drafts, draft_probs, sampler._generator_for(req))
    return [_sampled(token, row, logprobs, p.logprobs) for row, token in enumerate(tokens)]


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's choice, then that choice."""
    num_accepted = 0
    while num_accepted < len(drafts) and drafts[num_accepted] == targets[num_accepted]:
        num_accepted += 1
    return drafts[:num_accepted] + [targets[num_accepted]]


def rejection_sample(probs: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> list[int]:
    """probs: [len(drafts) + 1, vocab], the target's processed distributions."""
    num_drafts = len(drafts)
    draft_ids = torch.tensor(drafts, device=probs.device, dtype=torch.long)
    rows = torch.arange(num_drafts, device=probs.device)
    p_draft = probs[rows, draft_ids]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[rows, draft_ids]
    u = torch.rand(num_drafts, generator=generator, device=probs.device)
    rejected = (u * q_draft >= p_draft).nonzero()
    if rejected.numel() == 0:
        bonus = torch.multinomial(probs[num_drafts], 1, generator=generator)
        return drafts + [int(bonus)]
    first = int(rejected[0])
    return drafts[:first] + [_draw_residual(probs[first], drafts[first], draft_probs, first,
                                            generator)]


def _draw_residual(p: torch.Tensor, draft: int, draft_probs: torch.Tensor | None, row: int,
                   generator: torch.Generator) -> int:
    """A draw from norm(max(0, p - q)): p without the draft token for a point mass."""
    if draft_probs is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - draft_probs[row]).clamp_min(0.0)
    if not float(residual.sum()) > 0:
        residual = p  # p <= q everywhere only by rounding: p itself is the limit
    return int(torch.multinomial(residual, 1, generator=generator))


def target_probs(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The distribution the sampler draws from, per row: temperature, top-k, top-p."""
    p, rows = req.params, logits.shape[0]
    return torch.softmax(filter_logits(logits, [p.temperature] * rows, [p.top_k] * rows,
                                       [p.top_p] * rows), dim=-1)


def _ban_early_stop(logits: torch.Tensor, req: Request) -> None:
    """Row j follows j proposed tokens: below min_tokens there, EOS and stop tokens are out."""
    p = req.params
    num_banned_rows = min(p.min_tokens - req.num_output_tokens, logits.shape[0])
    if num_banned_rows <= 0:
        return
    banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(req.eos_token_ids))
    if banned:
        logits[:num_banned_rows, banned] = float("-inf")


def _sampled(token: int, row: int, logprobs: torch.Tensor | None, num_top: int | None
             ) -> SampledToken:
    if logprobs is None:
        return SampledToken(token)
    top = None
    if num_top:
        values, ids = torch.topk(logprobs[row], num_top)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampledToken(token, float(logprobs[row, token]), top)
