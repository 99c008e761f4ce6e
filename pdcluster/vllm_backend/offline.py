"""One generation with vLLM as pdcluster runs it (`pdcluster generate --engine vllm`): the same
`VllmEngine` a node serves, without a connector, driven to completion here."""

from __future__ import annotations

import time
from typing import Any

from pdcluster.core.sampling import SamplingSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.vllm_backend.engine import VllmEngine


def generate(model: str, prompt: str | list[int], sampling: SamplingSpec,
             timeout_s: float = 600.0, **engine_options: Any) -> tuple[list[int], str]:
    """(output token ids, text) of `prompt` (text, tokenized as the model's tokenizer
    does, or token ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
    engine = VllmEngine(EngineConfig(model, backend="vllm", **engine_options))
    try:
        engine.submit("generate", prompt_ids, sampling)
        token_ids: list[int] = []
        deadline = time.monotonic() + timeout_s
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM did not finish in {timeout_s:g} s")
            for out in engine.step():
                token_ids += out.new_token_ids
                if out.error:
                    raise RuntimeError(f"vLLM failed the request: {out.error}")
    finally:
        engine.close()
    return token_ids, tokenizer.decode(token_ids, skip_special_tokens=True)
