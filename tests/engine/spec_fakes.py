"""A proposer for speculative-decoding tests: it knows each prompt's true greedy continuation
and proposes it with planted mistakes, so every verification outcome (all accepted, a
mismatch at any position, nothing accepted) happens in a few steps. A fake subclassing the
real `Proposer` interface; it stands in for nothing in the product."""

from __future__ import annotations

from pdcluster.engine.core.request import Request
from pdcluster.engine.spec_decode.proposer import Proposer


class OracleProposer(Proposer):
    def __init__(self, continuations: dict[tuple[int, ...], list[int]], k: int,
                 vocab_size: int) -> None:
        self.continuations = continuations
        self.k = k
        self.vocab_size = vocab_size
        self.num_calls = 0

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        self.num_calls += 1
        return [self._draft(req, cap) for req, cap in zip(requests, max_tokens, strict=True)]

    def _draft(self, req: Request, cap: int) -> list[int]:
        truth = self.continuations.get(tuple(req.prompt_token_ids), [])
        done = req.num_output_tokens
        draft = list(truth[done:done + min(cap, self.k)])
        wrong_at = (done + self.num_calls) % (self.k + 2)  # k + 1: no mistake this time
        if wrong_at < len(draft):
            draft[wrong_at] = (draft[wrong_at] + 1) % self.vocab_size
        return draft


def use_proposer(llm, proposer: Proposer) -> None:
    """Swap the proposer of an engine built with speculation on."""
    llm.engine.spec_decoder.proposer = proposer
