"""Speculative decoding: propose several tokens cheaply, verify them in one target forward.

| module | owns | torch |
|---|---|---|
| `config.py` | `SpeculativeConfig`, parsed from `ngram:k=4` / `draft:PATH,k=4` | no |
| `proposer.py` | the `Proposer` interface every proposer implements | no |
| `ngram.py` | `NgramProposer`: prompt lookup over prompt + output so far | no |
| `draft.py` | `DraftProposer`: a smaller model with its own paged KV cache | yes |
| `decoder.py` | `SpecDecoder`: per-step proposals, adaptive back-off, statistics | no |
| `rejection.py` | verification: greedy acceptance, rejection sampling (Leviathan et al.) | yes |

The scheduler budgets each request's proposed tokens next to its last token
(`ScheduledRequest.spec_token_ids`), the runner computes them causally over the paged cache
as one multi-token chunk and `rejection.verify` keeps the longest accepted run plus one token
drawn from the target, so the output distribution is exactly the target model's.
This package's `__init__` imports nothing heavy: `engine.config` imports `config` from it.
"""

from pdcluster.engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
