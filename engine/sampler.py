"""Turns the last-position logits of each scheduled request into one token.

Greedy rows take argmax (first index on ties, as the reference does). Sampled rows apply
temperature, top-k and top-p, then draw with the request's own `torch.Generator` when it has a
seed, so a seeded request is reproducible whatever else shares its batch. Rows that have not
reached `min_tokens` cannot pick EOS or a stop token. Logprobs are of the model's distribution
(before temperature and filters).

Isolation: one request's parameters must not fail the others. The batched stage (log-softmax,
min_tokens bans, argmax) runs once for every row and draws no randomness; should it raise, it
is redone row by row and only the rows that raise again fail. The per-row stage (drawing,
logprobs) fails only its own row. A failed row is a `RequestFailure`, which finishes that
request with an error; every other row's token is what it would have been without it.
"""

from __future__ import annotations

import logging

import torch

from pdcluster.engine.outputs import RequestFailure, SampledToken
from pdcluster.engine.request import Request

logger = logging.getLogger(__name__)
_FAILED = "sampling failed on the node"


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._req_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._req_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]
               ) -> list[SampledToken | RequestFailure]:
        """logits: [len(requests), vocab] float32 (modified in place)."""
        try:
            logprobs, greedy = _batched(logits, requests)
        except Exception:
            logger.exception("batched sampling failed; sampling %d rows one by one",
                             len(requests))
            return [self._sample_alone(logits[row:row + 1], req)
                    for row, req in enumerate(requests)]
        return [self._pick_guarded(logits, logprobs, greedy, row, req)
                for row, req in enumerate(requests)]

    def _sample_alone(self, logits: torch.Tensor, req: Request
                      ) -> SampledToken | RequestFailure:
        try:
            logprobs, greedy = _batched(logits, [req])
        except Exception:
            logger.exception("sampling failed for request %s", req.request_id)
            return RequestFailure(_FAILED)
        return self._pick_guarded(logits, logprobs, greedy, 0, req)

    def _pick_guarded(self, logits: torch.Tensor, logprobs: torch.Tensor | None,
                      greedy: list[int], row: int, req: Request
                      ) -> SampledToken | RequestFailure:
        try:
            return self._pick(logits, logprobs, greedy, row, req)
        except Exception:
            logger.exception("sampling failed for request %s", req.request_id)
            return RequestFailure(_FAILED)

    def _pick(self, logits: torch.Tensor, logprobs: torch.Tensor | None, greedy: list[int],
              row: int, req: Request) -> SampledToken:
        p = req.params
        token = greedy[row] if p.is_greedy else self._sample_row(logits[row], req)
        if p.logprobs is None:
            return SampledToken(token)
        top = None
        if p.logprobs > 0:
            values, ids = torch.topk(logprobs[row], p.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return SampledToken(token, float(logprobs[row, token]), top)

    def _sample_row(self, logits: torch.Tensor, req: Request) -> int:
        p = req.params
        logits = logits / p.temperature
        if 0 < p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1.0:
            logits = _top_p_filter(logits, p.top_p)
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator_for(req)))

    def _generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        gen = self._req_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self._req_generators[req.request_id] = gen
        return gen


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
    # Drop a token when the mass before it already reaches top_p; the top token always stays.
    drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _batched(logits: torch.Tensor, requests: list[Request]
             ) -> tuple[torch.Tensor | None, list[int]]:
    """(log-softmax of the raw logits if any row wants logprobs, argmax of every row)."""
    need_logprobs = any(r.params.logprobs is not None for r in requests)
    logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
    _block_early_stop(logits, requests)
    return logprobs, torch.argmax(logits, dim=-1).tolist()


def _block_early_stop(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rows below min_tokens cannot pick EOS or a stop token. Every index is checked before
    any is written, so a bad one leaves the logits untouched for the row-by-row retry."""
    rows: list[int] = []
    cols: list[int] = []
    for row, req in enumerate(requests):
        if req.num_output_tokens < req.params.min_tokens:
            banned = list(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned += list(req.eos_token_ids)
            rows += [row] * len(banned)
            cols += banned
    if not cols:
        return
    if min(cols) < 0 or max(cols) >= logits.shape[-1]:
        raise IndexError(f"a banned token id is outside the vocabulary of {logits.shape[-1]}")
    logits[rows, cols] = float("-inf")
