"""The interface every proposer implements (torch-free).

A proposer sees the running requests in decode and returns, per request, up to `max_tokens`
draft tokens that continue `request.all_token_ids`; an empty list proposes nothing and the
request decodes one token as usual. Proposals are point masses (q(x) = 1 for the proposed
token): exact for n-gram lookup and greedy drafting. A sampling draft (or EAGLE-style heads)
would also return its distributions; `rejection.verify` already takes them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdcluster.core.types import ReqId
from pdcluster.engine.core.request import Request


class Proposer(ABC):
    @abstractmethod
    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        """One list of draft tokens per request, each at most `max_tokens[i]` long."""

    def forget(self, request_id: ReqId) -> None:  # noqa: B027 - stateless proposers keep none
        """Drop whatever is kept for a finished or aborted request."""

    def retain(self, request_ids: set[ReqId]) -> None:  # noqa: B027
        """Drop state of every request not in `request_ids` (a safety net for missed ends)."""
