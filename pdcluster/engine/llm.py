"""`LLM`: offline batch generation on top of `LLMEngine`.

    llm = LLM("path/to/model", dtype="float32")   # or a .gguf file (converted once:
                                                  # engine.models.gguf)
    outs = llm.generate(["Hello", [1, 15043]], SamplingParams(temperature=0, max_tokens=16))
    outs[0].text, outs[0].token_ids
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core.outputs import RequestOutput
from pdcluster.engine.core.sampling_params import SamplingParams, as_params_list
from pdcluster.engine.llm_engine import LLMEngine
from pdcluster.engine.models.gguf import resolve_model


class LLM:
    def __init__(self, model: str, **options) -> None:
        self.engine = LLMEngine(EngineConfig(model=resolve_model(model), **options))
        self._ids = itertools.count()

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        batch = _as_batch(prompts)
        params = as_params_list(sampling_params, len(batch))
        ids = [f"gen-{next(self._ids)}" for _ in batch]
        try:
            for rid, prompt, p in zip(ids, batch, params, strict=True):
                self.engine.add_request(rid, prompt, p)
        except ValueError:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]


def _as_batch(prompts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    """One prompt (text, or token ids) or several, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [cast("list[int]", prompts)]  # a list of ints is one prompt of token ids
    return list(cast("Sequence[str | list[int]]", prompts))
