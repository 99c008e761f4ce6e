"""The torch LLM engine that prefill and decode nodes run.

Public API: `LLM` (offline batch generation), `LLMEngine` (step loop: add_request, step,
abort_request), `SamplingParams`, `RequestOutput`, `EngineConfig`. Bookkeeping — block pool,
KV cache manager, scheduler, request — is torch-free; the model, attention, KV tensor, runner
and sampler are torch. See docs/engine.md.
"""

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
