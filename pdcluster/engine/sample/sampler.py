"""Turns the last-position logits of each scheduled request into one token.

Greedy rows take argmax (first index on ties, as the reference does). Sampled rows apply
temperature, top-k and top-p, then draw (engine.sample.draw, all rows at once on the device)
with the request's own `torch.Generator` when it has a seed, so a seeded request is reproducible
whatever else shares its batch. The step's tokens reach the host in one copy. Before either, in
one batched pass: `logit_bias` and the penalties (engine.sample.logits_processors), the
min_tokens bans (rows that have not reached `min_tokens` cannot pick EOS or a stop token), and
the grammar masks of guided requests (engine.sample.structured_output). Logprobs are of the
model's distribution (before all of these, temperature and filters included).

Isolation: one request's parameters must not fail the others. The batched stage draws its
randomness last, after everything that can raise; should it raise, it is redone row by row on
the original logits and only the rows that raise again fail. A row whose probabilities are not a
distribution (a NaN temperature slipped past validation) fails alone. A guided row whose grammar
fails, or leaves no token allowed, fails alone; the per-row stage (logprobs, feeding
the grammar) fails only its own row. A failed row is a `RequestFailure`, which finishes that
request with an error; every other row's token is what it would have been without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdcluster.engine.core.outputs import RequestFailure, SampledToken
from pdcluster.engine.core.request import Request
from pdcluster.engine.sample.draw import draw
from pdcluster.engine.sample.logits_processors import LogitsProcessors, uses_processors
from pdcluster.engine.sample.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutput,
)

logger = logging.getLogger(__name__)
_FAILED = "sampling failed on the node"
_NO_TOKEN = ("structured output: no token is allowed by both the grammar and the request's "
             "other constraints (min_tokens, stop_token_ids)")


@dataclass(slots=True)
class _Batch:
    """The batched stage's results: log-softmax of the raw logits (if any row wants
    logprobs), every row's argmax, the random rows' draws (and those whose distribution was
    not one), and the guided rows that failed or have no token left."""

    logprobs: torch.Tensor | None
    greedy: list[int]
    failed: dict[int, str] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    drawn: dict[int, int] = field(default_factory=dict)
    invalid: set[int] = field(default_factory=set)


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._req_generators: dict[str, torch.Generator] = {}
        self.processors = LogitsProcessors(device)
        self.structured: StructuredOutput | None = None

    def use_grammars(self, compiler: GrammarCompiler) -> None:
        """Enable guided requests (the engine's compiler, which admission validated with)."""
        self.structured = StructuredOutput(compiler)

    def forget(self, request_id: str) -> None:
        self._req_generators.pop(request_id, None)
        self.processors.forget(request_id)
        if self.structured is not None:
            self.structured.forget(request_id)

    def sample(self, logits: torch.Tensor, requests: list[Request],
               launch: Callable[[torch.Tensor], None] | None = None
               ) -> list[SampledToken | RequestFailure]:
        """logits: [len(requests), vocab] float32 (modified in place). `launch`, if given, is
        called with every row's token on the device once the copy of the step's tokens to the
        host is queued and before it is waited for (engine/runner/lookahead.py): it may queue
        more device work, which then runs while the host goes on. It must not raise."""
        original = logits.clone() if any(_transforms(r) for r in requests) else None
        try:
            batch = self._batched(logits, requests, launch)
        except Exception:
            logger.exception("batched sampling failed; sampling %d rows one by one",
                             len(requests))
            if original is not None:  # undo what the failed pass wrote
                logits = original
            return [self._sample_alone(logits[row:row + 1], req)
                    for row, req in enumerate(requests)]
        return [self._pick_guarded(logits, batch, row, req) for row, req in enumerate(requests)]

    def _sample_alone(self, logits: torch.Tensor, req: Request
                      ) -> SampledToken | RequestFailure:
        try:
            batch = self._batched(logits, [req])
        except Exception:
            logger.exception("sampling failed for request %s", req.request_id)
            return RequestFailure(_FAILED)
        return self._pick_guarded(logits, batch, 0, req)

    def _batched(self, logits: torch.Tensor, requests: list[Request],
                 launch: Callable[[torch.Tensor], None] | None = None) -> _Batch:
        need_logprobs = any(r.params.logprobs is not None for r in requests)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None
        self.processors.apply(logits, requests)
        _block_early_stop(logits, requests)
        failed, dead = self._mask_grammars(logits, requests)
        greedy = torch.argmax(logits, dim=-1)
        rows = [row for row, req in enumerate(requests) if not req.params.is_greedy]
        if not rows:
            return _Batch(logprobs, self._to_host(greedy, greedy, launch), failed, dead)
        params = [requests[row].params for row in rows]
        tokens, valid = draw(logits[rows], [p.temperature for p in params],
                             [p.top_k for p in params], [p.top_p for p in params],
                             [self._generator_for(requests[row]) for row in rows])
        chosen = None
        if launch is not None:  # each row's token: its argmax, or its draw
            chosen = greedy.index_put((torch.tensor(rows, device=greedy.device),), tokens)
        # the step's one device-to-host copy: every row's argmax, the draws and their flags
        merged = self._to_host(torch.cat((greedy, tokens, valid.long())), chosen, launch)
        n, m = len(requests), len(rows)
        return _Batch(logprobs, merged[:n], failed, dead,
                      dict(zip(rows, merged[n: n + m], strict=True)),
                      {row for row, ok in zip(rows, merged[n + m:], strict=True) if not ok})

    def _to_host(self, values: torch.Tensor, chosen: torch.Tensor | None,
                 launch: Callable[[torch.Tensor], None] | None) -> list[int]:
        """`values` on the host; `launch(chosen)` runs between queueing the copy and
        waiting for it."""
        if launch is None or chosen is None:
            return values.tolist()
        pinned = values.is_cuda
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=pinned)
        host.copy_(values, non_blocking=pinned)
        copied = torch.cuda.Event() if pinned else None
        if copied is not None:
            copied.record()
        launch(chosen)
        if copied is not None:
            copied.synchronize()
        return host.tolist()

    def _mask_grammars(self, logits: torch.Tensor, requests: list[Request]
                       ) -> tuple[dict[int, str], set[int]]:
        """Mask every guided row at once; ({row: error}, rows left with no allowed token)."""
        rows = [row for row, req in enumerate(requests) if req.params.guided is not None]
        if not rows:
            return {}, set()
        if self.structured is None:
            return dict.fromkeys(rows, "guided decoding is not enabled on this engine"), set()
        failed = self.structured.mask(logits, rows, [requests[row] for row in rows])
        alive = [row for row in rows if row not in failed]
        blocked = torch.isneginf(logits[alive]).all(dim=-1).tolist() if alive else []
        return failed, {row for row, dead in zip(alive, blocked, strict=True) if dead}

    def _pick_guarded(self, logits: torch.Tensor, batch: _Batch, row: int, req: Request
                      ) -> SampledToken | RequestFailure:
        if row in batch.failed:
            return RequestFailure(batch.failed[row])
        try:
            return self._pick(logits, batch, row, req)
        except GrammarError as exc:  # the grammar refused the token: a clear reason
            return RequestFailure(str(exc))
        except Exception:
            logger.exception("sampling failed for request %s", req.request_id)
            return RequestFailure(_FAILED)

    def _pick(self, logits: torch.Tensor, batch: _Batch, row: int, req: Request
              ) -> SampledToken:
        p = req.params
        if row in batch.dead:
            token, ended = self._end_grammar(req), True
        else:
            token = batch.greedy[row] if p.is_greedy else _drawn(batch, row, req)
            ended = p.guided is not None and self._grammars().accept(req, token)
        if p.logprobs is None:
            return SampledToken(token, grammar_ended=ended)
        logprobs = batch.logprobs
        assert logprobs is not None, "the batched stage computes logprobs when a row asks"
        top = None
        if p.logprobs > 0:
            values, ids = torch.topk(logprobs[row], p.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        return SampledToken(token, float(logprobs[row, token]), top, ended)

    def _end_grammar(self, req: Request) -> int:
        """A guided row with no allowed token: its grammar ends here if it may (EOS), else
        the request fails."""
        grammars = self._grammars()
        if not grammars.is_accepting(req):
            raise GrammarError(_NO_TOKEN)
        return grammars.compiler.eos_token_ids[0]

    def _grammars(self) -> StructuredOutput:
        """Structured output, for a guided row past the batched stage: without grammars
        `_mask_grammars` has failed every guided row already."""
        assert self.structured is not None, "a guided row got past the batched stage"
        return self.structured

    def _generator_for(self, req: Request) -> torch.Generator:
        if req.params.seed is None:
            return self.generator
        gen = self._req_generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(req.params.seed)
            self._req_generators[req.request_id] = gen
        return gen


def _drawn(batch: _Batch, row: int, req: Request) -> int:
    if row in batch.invalid:
        raise ValueError(f"sampling probabilities of request {req.request_id} are not a "
                         "distribution (NaN or all zero)")
    return batch.drawn[row]


def _transforms(req: Request) -> bool:
    """Whether the batched stage rewrites more than a few of this row's logits."""
    return uses_processors(req.params) or req.params.guided is not None


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
