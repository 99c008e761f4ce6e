"""Which model implementation serves which Hugging Face `architectures` name.

`model_class(architecture)` returns the `nn.Module` class to build; `SUPPORTED_ARCHITECTURES`
(torch-free, in `engine.models.model_config`) is the list users see in errors. Family modules are
imported on demand, so loading a Llama never imports the MLA code; they are named relative to
this package (`"llama:CausalLM"` is `pdcluster.engine.models.llama`), so the name cannot
drift from where the package is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pdcluster.engine.models.model_config import SUPPORTED_ARCHITECTURES

if TYPE_CHECKING:
    from pdcluster.engine.models.llama import CausalLM

_IMPLEMENTATIONS = {
    "LlamaForCausalLM": "llama:CausalLM",
    "MistralForCausalLM": "llama:CausalLM",
    "Qwen2ForCausalLM": "llama:CausalLM",
    "Qwen3ForCausalLM": "llama:CausalLM",
    "MixtralForCausalLM": "llama:CausalLM",
    "Qwen3MoeForCausalLM": "llama:CausalLM",
    "DeepseekV2ForCausalLM": "deepseek:DeepseekForCausalLM",
    "DeepseekV3ForCausalLM": "deepseek:DeepseekForCausalLM",
}
assert set(_IMPLEMENTATIONS) == set(SUPPORTED_ARCHITECTURES), "registry out of sync"


def model_class(architecture: str) -> type[CausalLM]:
    """Every implementation is a `CausalLM` (families subclass it)."""
    target = _IMPLEMENTATIONS.get(architecture)
    if target is None:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    module, name = target.split(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)
