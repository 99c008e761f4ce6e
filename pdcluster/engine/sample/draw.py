"""Random draws for a batch of rows at once, on the logits' device, with no host sync.

Each row is scaled by its temperature, cut to its top-k and its top-p nucleus (the top token
always stays), normalised, and drawn by an exponential race: `argmax(p_i / E_i)` with `E_i`
independent Exp(1) variables picks token i with probability p_i (the Gumbel-max trick in
another form). Each row's variables come from its own generator (a seeded request's, or the
sampler's), so a seeded request draws the same tokens whatever else shares its batch.

A row whose probabilities are not a distribution (NaN from a NaN temperature, or nothing left)
is drawn from a stand-in and flagged invalid: the caller fails that row alone. On CUDA no such
row can reach an op that asserts on the device (multinomial does), which would poison every
request of the process.

API: `draw(logits, temperatures, top_ks, top_ps, generators) -> (tokens, valid)`,
`filter_logits(logits, temperatures, top_ks, top_ps)`.
"""

from __future__ import annotations

import torch


def draw(logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
         top_ps: list[float], generators: list[torch.Generator]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [n, vocab]` (not modified) -> `(tokens [n] int64, valid [n] bool)`, on the
    logits' device. `top_ks[i]` of 0 (or the vocabulary or more) and `top_ps[i]` of 1 turn
    that filter off for row i."""
    probs = torch.softmax(filter_logits(logits, temperatures, top_ks, top_ps), dim=-1)
    valid = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
    probs = torch.where(valid[:, None], probs, torch.ones_like(probs))
    races = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        races[row].exponential_(generator=generator)
    return torch.argmax(probs / races.clamp_min_(torch.finfo(races.dtype).tiny), dim=-1), valid


def filter_logits(logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
                  top_ps: list[float]) -> torch.Tensor:
    """Each row scaled by its temperature, outside its top-k and top-p nucleus -inf: the
    logits whose softmax `draw` samples from (speculative decoding's verification too)."""
    device, vocab = logits.device, logits.shape[-1]
    x = logits / torch.tensor(temperatures, dtype=logits.dtype, device=device)[:, None]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]
    if any(ks):
        x = _top_k(x, torch.tensor(ks, device=device), max(ks))
    if any(p < 1.0 for p in top_ps):
        x = _top_p(x, torch.tensor(top_ps, dtype=x.dtype, device=device))
    return x


def _top_k(x: torch.Tensor, ks: torch.Tensor, largest_k: int) -> torch.Tensor:
    """Rows with k > 0 keep their k largest logits (and ties with the k-th)."""
    values = torch.topk(x, largest_k, dim=-1).values
    kth = values.gather(1, (ks - 1).clamp_min(0)[:, None])
    cut = (x < kth) & (ks > 0)[:, None]
    return x.masked_fill(cut, float("-inf"))


def _top_p(x: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Rows with top_p < 1 drop a token when the mass of the tokens before it already reaches
    top_p (the top token always stays)."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    probs = torch.softmax(sorted_x, dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
    drop_sorted &= (top_ps < 1.0)[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))
