"""The torch LLM engine that prefill and decode nodes run.

Public API: `LLM` (offline batch generation), `LLMEngine` (step loop: add_request, step,
abort_request), `SamplingParams`, `RequestOutput`, `EngineConfig`. Bookkeeping — block pool,
KV cache manager, scheduler, request — is torch-free; the model, attention, KV tensor, runner
and sampler are torch. The names load lazily, so importing a torch-free module such as
`engine.core.scheduler` does not import torch. See docs/engine.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineConfig": "pdcluster.engine.config",
    "LLM": "pdcluster.engine.llm",
    "LLMEngine": "pdcluster.engine.llm_engine",
    "RequestOutput": "pdcluster.engine.core.outputs",
    "SamplingParams": "pdcluster.engine.core.sampling_params",
}
__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from pdcluster.engine.config import EngineConfig
    from pdcluster.engine.core.outputs import RequestOutput
    from pdcluster.engine.core.sampling_params import SamplingParams
    from pdcluster.engine.llm import LLM
    from pdcluster.engine.llm_engine import LLMEngine


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
