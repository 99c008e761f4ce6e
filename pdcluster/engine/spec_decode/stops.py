"""Stop strings under speculation (torch-free): a verified run appends several tokens in one
step, and a stop string may end inside it. Plain decoding would have stopped at the first
token whose text contains a stop string, so the run is cut back to that token."""

from __future__ import annotations

from pdcluster.engine.core.outputs import StopStringChecker
from pdcluster.engine.core.request import Request


def cut_at_first_stop(checker: StopStringChecker, req: Request, num_before: int
                      ) -> tuple[str, str] | None:
    """Find the fewest output tokens past `num_before` whose text holds a stop string, drop
    the tokens after them, and return (stop string, cut text); None if no prefix has one."""
    for num_tokens in range(num_before + 1, req.num_output_tokens + 1):
        text = checker.tokenizer.decode(req.output_token_ids[:num_tokens],
                                        skip_special_tokens=req.params.skip_special_tokens)
        hit = checker.find(req, text)
        if hit is not None:
            truncate_output(req, num_tokens)
            return hit
    return None


def truncate_output(req: Request, num_output_tokens: int) -> None:
    """Keep the first `num_output_tokens` output tokens (and their logprobs). Only for a
    request about to finish: its block hashes are not rewound."""
    num_dropped = req.num_output_tokens - num_output_tokens
    if num_dropped <= 0:
        return
    del req.output_token_ids[num_output_tokens:]
    del req.all_token_ids[len(req.all_token_ids) - num_dropped:]
    del req.logprobs[num_output_tokens:]
    del req.top_logprobs[num_output_tokens:]
    req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens)
