"""The sampler's batched logits processors: `logit_bias` and the three penalties
(engine.core.sampling_params documents their meaning). Each is one tensor operation over every row
that uses it, whatever the mix of settings in the batch: a row with neutral values (bias 0,
penalties 0/0/1) comes out bit-identical, so a request samples the same tokens alone or in
any batch.

Penalties need each request's token counts. They are kept per request (a `[vocab]` count of
its output tokens, and a `[vocab]` mask of its prompt's tokens for the repetition penalty)
and brought up to date incrementally from the request's output — only the tokens added since
the last step — so tokens that arrived from elsewhere (a prefill node's first token) count
too. `forget` drops a finished request's state.

API: `LogitsProcessors(device)`, `.apply(logits, requests)`, `.forget(request_id)`,
`uses_processors(params)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdcluster.core.types import ReqId
from pdcluster.engine.core.request import Request
from pdcluster.engine.core.sampling_params import SamplingParams


def uses_processors(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.has_penalties


@dataclass(slots=True)
class _Counts:
    output: torch.Tensor  # float32 [vocab]: occurrences of each token in the output
    in_prompt: torch.Tensor | None  # bool [vocab]; only with a repetition penalty
    num_counted: int = 0


class LogitsProcessors:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._counts: dict[ReqId, _Counts] = {}
        self._bias: dict[ReqId, tuple[torch.Tensor, torch.Tensor]] = {}

    def forget(self, request_id: ReqId) -> None:
        self._counts.pop(request_id, None)
        self._bias.pop(request_id, None)

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """In place on `logits` [len(requests), vocab]: bias first, then penalties (as vLLM
        orders them). Token ids were checked against the vocabulary at admission."""
        self._apply_bias(logits, requests)
        rows = [row for row, req in enumerate(requests) if req.params.has_penalties]
        if rows:
            self._apply_penalties(logits, rows, [requests[row] for row in rows])

    def _apply_bias(self, logits: torch.Tensor, requests: list[Request]) -> None:
        rows: list[torch.Tensor] = []
        cols: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for row, req in enumerate(requests):
            if req.params.logit_bias:
                token_ids, bias = self._bias_of(req, logits.shape[-1])
                rows.append(torch.full_like(token_ids, row))
                cols.append(token_ids)
                values.append(bias)
        if rows:
            logits.index_put_((torch.cat(rows), torch.cat(cols)), torch.cat(values),
                              accumulate=True)

    def _bias_of(self, req: Request, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._bias.get(req.request_id)
        if cached is None:
            bias = req.params.logit_bias
            # checked here too, on the host: an id past the vocabulary in index_put_ is a
            # device-side assert on CUDA, which would fail every request of the process
            if min(bias) < 0 or max(bias) >= vocab:
                raise IndexError(f"a logit_bias token id is outside the vocabulary of {vocab}")
            cached = (torch.tensor(list(bias), dtype=torch.long, device=self.device),
                      torch.tensor(list(bias.values()), dtype=torch.float32,
                                   device=self.device))
            self._bias[req.request_id] = cached
        return cached

    def _apply_penalties(self, logits: torch.Tensor, rows: list[int],
                         requests: list[Request]) -> None:
        vocab = logits.shape[-1]
        counts = [self._synced(req, vocab) for req in requests]
        output = torch.stack([c.output for c in counts])
        seen = output > 0
        index = torch.tensor(rows, device=self.device)
        selected = logits[index]
        if any(req.params.repetition_penalty != 1.0 for req in requests):
            selected = _repetition(selected, seen, counts, requests)
        frequency = self._column([r.params.frequency_penalty for r in requests])
        presence = self._column([r.params.presence_penalty for r in requests])
        selected = selected - frequency * output - presence * seen
        logits[index] = selected.to(logits.dtype)

    def _column(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)[:, None]

    def _synced(self, req: Request, vocab: int) -> _Counts:
        """The request's counts, brought up to date with the tokens added since last time."""
        counts = self._counts.get(req.request_id)
        if counts is None or counts.num_counted > req.num_output_tokens:  # output rewound
            counts = _Counts(torch.zeros(vocab, dtype=torch.float32, device=self.device),
                             self._prompt_mask(req, vocab))
            self._counts[req.request_id] = counts
        new = req.output_token_ids[counts.num_counted:]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.device)
            counts.output.index_add_(0, ids, torch.ones(len(new), device=self.device))
            counts.num_counted = req.num_output_tokens
        return counts

    def _prompt_mask(self, req: Request, vocab: int) -> torch.Tensor | None:
        if req.params.repetition_penalty == 1.0:
            return None
        mask = torch.zeros(vocab, dtype=torch.bool, device=self.device)
        mask[torch.tensor(req.prompt_token_ids, dtype=torch.long, device=self.device)] = True
        return mask


def _repetition(selected: torch.Tensor, seen: torch.Tensor, counts: list[_Counts],
                requests: list[Request]) -> torch.Tensor:
    """HF's repetition penalty on every token of the prompt or the output: divide a positive
    logit by it, multiply a negative one. Rows with penalty 1 are unchanged exactly."""
    in_prompt = torch.stack([c.in_prompt if c.in_prompt is not None else torch.zeros_like(s)
                             for c, s in zip(counts, seen, strict=True)])
    penalty = torch.tensor([r.params.repetition_penalty for r in requests],
                           dtype=torch.float32, device=selected.device)[:, None]
    penalized = torch.where(selected > 0, selected / penalty, selected * penalty)
    return torch.where(seen | in_prompt, penalized, selected)
