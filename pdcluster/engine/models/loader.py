"""Load a Hugging Face checkpoint folder (`config.json` + `*.safetensors`, sharded or not)
into the model class that `registry.model_class` picks from `architectures`, fusing weights
as they stream in: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, and each expert's
gate/up/down into the stacked `experts.w13` `[E, 2I, H]` / `experts.w2` `[E, H, I]` (per-expert
checkpoints, Mixtral's `block_sparse_moe.experts.E.w1/w2/w3` included, or transformers-5's
already stacked `experts.gate_up_proj` / `experts.down_proj`). Every parameter must be covered
exactly once (`_check_complete`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.models.registry import model_class

if TYPE_CHECKING:
    from pdcluster.engine.models.llama import CausalLM

logger = logging.getLogger(__name__)

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_FUSED = re.compile(r"^(.*)\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$")
_SHARD = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int, dummy: bool = False) -> CausalLM:
    """The model of `cfg` with the folder's weights, or with random ones (`dummy`: no
    weight file is read)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files and not dummy:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {path}")
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, max_positions).to(dtype=dtype)  # each weight allocated once, in dtype
    model.to_empty(device=device)
    # RoPE tables are buffers computed from config, not weights: rebuild them on the device
    # (float32, as the reference computes them; each use casts them to the activations' dtype).
    model.init_buffers(device)
    if dummy:
        _fill_random(model)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, int] = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                _load_tensor(model, cfg, params, name, f.get_tensor(name), loaded)
    _check_complete(cfg, params, loaded)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


@torch.no_grad()
def _fill_random(model: torch.nn.Module) -> None:
    """Weights of a plausible scale (normal, std 0.02; norms 1, biases 0), so activations stay
    in range over many layers; drawn on the device, in its dtype."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02)


def _load_tensor(model, cfg: ModelConfig, params, name: str, tensor, loaded) -> None:
    if _IGNORED.search(name) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return
    hf_name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    layer = _LAYER.match(hf_name)
    if layer and int(layer.group(1)) >= cfg.num_layers:
        logger.debug("skipping %s: beyond the model's layers (e.g. DeepSeek-V3's MTP)", name)
        return
    our_name, view = _target(model, params, hf_name)
    if view is None:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    if view.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies "
                         f"{tuple(view.shape)}")
    with torch.no_grad():
        view.copy_(tensor)
    loaded[our_name] = loaded.get(our_name, 0) + view.numel()


def _target(model, params, name: str) -> tuple[str, torch.Tensor | None]:
    """(our parameter, the view of it that checkpoint tensor `name` fills)."""
    if name in params:
        return name, params[name]
    if m := _EXPERT.match(name):
        prefix, expert, part = m.group(1), int(m.group(2)), m.group(3)
        if part in ("w2", "down_proj"):
            return f"{prefix}.w2", _get(params, f"{prefix}.w2", expert)
        w13 = f"{prefix}.w13"
        half = params[w13].shape[1] // 2 if w13 in params else 0
        start = 0 if part in ("w1", "gate_proj") else half
        return w13, _get(params, w13, expert, start, half)
    if m := _STACKED.match(name):
        ours = f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
        return ours, params.get(ours)
    if m := _FUSED.match(name):
        fused, shard = _SHARD[m.group(2)]
        ours = f"{m.group(1)}.{fused}.{m.group(3)}"
        if ours in params:
            sizes = model.get_submodule(f"{m.group(1)}.{fused}").shard_sizes
            start = sum(sizes[:shard])
            return ours, params[ours].narrow(0, start, sizes[shard])
    return name, None


def _get(params, name: str, expert: int, start: int = 0, size: int = 0):
    if name not in params or expert >= params[name].shape[0]:
        return None
    view = params[name][expert]
    return view.narrow(0, start, size) if size else view


def _check_complete(cfg: ModelConfig, params, loaded: dict[str, int]) -> None:
    missing, twice = [], []
    for name, param in params.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        got = loaded.get(name, 0)
        if got < param.numel():
            missing.append(f"{name} ({got} of {param.numel()} values)")
        elif got > param.numel():
            twice.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
    if twice:
        raise ValueError(f"checkpoint has duplicate weights for {twice[:3]}")
