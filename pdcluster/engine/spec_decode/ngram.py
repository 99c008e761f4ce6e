"""`NgramProposer`: prompt lookup decoding (torch-free; numpy).

For n from `max_n` down to `min_n`, take the request's last n tokens and look for their most
recent earlier occurrence in prompt + output so far; propose the (up to k) tokens that
followed it. Strong where the output repeats the input: code edits, document QA, RAG,
multi-turn chat. No match at any size proposes nothing, so a request whose text does not
repeat decodes as it would without speculation. One vectorised scan per size per request.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdcluster.engine.core.request import Request
from pdcluster.engine.spec_decode.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        return [self.lookup(r.all_token_ids, k) if k > 0 else []
                for r, k in zip(requests, max_tokens, strict=True)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The continuation of the last n-gram's most recent earlier occurrence, longest n
        first; [] when no size matches."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = _last_match(tokens, n)
            if start is not None:
                return tokens[start + n: start + n + k].tolist()
        return []


def _last_match(tokens: np.ndarray, n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the end."""
    windows = sliding_window_view(tokens[:-1], n)  # every n-gram but the suffix itself
    hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None
