"""Turns the last-position logits of each scheduled request into one token.

Greedy rows take argmax (first index on ties, as the reference does). Sampled rows apply
temperature, top-k and top-p, then draw with the request's own `torch.Generator` when it has a
seed, so a seeded request is reproducible whatever else shares its batch. Rows that have not
reached `min_tokens` cannot pick EOS or a stop token. Logprobs are of the model's distribution
(before temperature and filters).
"""

from __future__ import annotations

import torch

from engine.outputs import SampledToken
from engine.request import Request


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._req_generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._req_generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [len(requests), vocab] float32 (modified in place)."""
        need_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
        _block_early_stop(logits, requests)
        token_ids = torch.argmax(logits, dim=-1)
        for row, req in enumerate(requests):
            if not req.params.is_greedy:
                token_ids[row] = self._sample_row(logits[row], req)
        chosen = token_ids.tolist()
        if logprobs is None:
            return [SampledToken(t) for t in chosen]
        return _with_logprobs(logprobs, requests, chosen)

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


def _block_early_stop(logits: torch.Tensor, requests: list[Request]) -> None:
    for row, req in enumerate(requests):
        if req.num_output_tokens < req.params.min_tokens:
            banned = list(req.params.stop_token_ids)
            if not req.params.ignore_eos:
                banned += list(req.eos_token_ids)
            if banned:
                logits[row, banned] = float("-inf")


def _with_logprobs(logprobs, requests, chosen: list[int]) -> list[SampledToken]:
    out = []
    for row, (req, token) in enumerate(zip(requests, chosen, strict=True)):
        k = req.params.logprobs
        if k is None:
            out.append(SampledToken(token))
            continue
        top = None
        if k > 0:
            values, ids = torch.topk(logprobs[row], k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(SampledToken(token, float(logprobs[row, token]), top))
    return out
