"""Which model implementation serves which Hugging Face `architectures` name.

`model_class(architecture)` returns the `nn.Module` class to build; `SUPPORTED_ARCHITECTURES`
(torch-free, in `engine.model_config`) is the list users see in errors. Family modules are
imported on demand, so loading a Llama never imports the MLA code.
"""

from __future__ import annotations

import importlib

from torch import nn

from pdcluster.engine.model_config import SUPPORTED_ARCHITECTURES

_IMPLEMENTATIONS = {
    "LlamaForCausalLM": "engine.models.llama:CausalLM",
    "MistralForCausalLM": "engine.models.llama:CausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:CausalLM",
    "Qwen3ForCausalLM": "engine.models.llama:CausalLM",
    "MixtralForCausalLM": "engine.models.llama:CausalLM",
    "Qwen3MoeForCausalLM": "engine.models.llama:CausalLM",
    "DeepseekV2ForCausalLM": "engine.models.deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "engine.models.deepseek:DeepseekForCausalLM",
}
assert set(_IMPLEMENTATIONS) == set(SUPPORTED_ARCHITECTURES), "registry out of sync"


def model_class(architecture: str) -> type[nn.Module]:
    target = _IMPLEMENTATIONS.get(architecture)
    if target is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)
