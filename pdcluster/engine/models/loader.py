"""Load a Hugging Face checkpoint folder (`config.json` + `*.safetensors`, sharded or not)
into the model class that `registry.model_class` picks from `architectures`, fusing weights
as they stream in: q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, and each expert's
gate/up/down into the stacked `experts.w13` `[E, 2I, H]` / `experts.w2` `[E, H, I]` (per-expert
checkpoints, Mixtral's `block_sparse_moe.experts.E.w1/w2/w3` included, or transformers-5's
already stacked `experts.gate_up_proj` / `experts.down_proj`). Every parameter must be covered
exactly once (`_check_complete`). With tensor parallelism (engine/models/parallel.py) each rank
copies its slice of each tensor (its rows of a column-parallel layer's parts, its columns of a
row-parallel one, its rows of the vocabulary) and skips the other ranks' routed experts.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.models.parallel import SINGLE, TensorParallel
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
               max_positions: int, dummy: bool = False, tp: TensorParallel = SINGLE
               ) -> CausalLM:
    """The model of `cfg` with the folder's weights, or with random ones (`dummy`: no
    weight file is read); with tensor parallelism, this rank's slices of them."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files and not dummy:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {path}")
    cls = model_class(cfg.architecture)
    with torch.device("meta"):
        model = cls(cfg, max_positions, tp).to(dtype=dtype)  # each weight allocated once
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
    target = _target(model, params, hf_name)
    if target is _ELSEWHERE:  # another tensor-parallel rank's expert
        return
    if target is None:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    our_name, view, part = target
    tensor = part(tensor)
    if view.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies "
                         f"{tuple(view.shape)}")
    with torch.no_grad():
        view.copy_(tensor)
    loaded[our_name] = loaded.get(our_name, 0) + view.numel()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _rows(dim: int, start: int, length: int):
    """This rank's slice of a checkpoint tensor along `dim`."""
    return lambda tensor: tensor.narrow(dim, start, length)


_ELSEWHERE = ("", None, _whole)  # a checkpoint tensor that another rank holds


def _target(model, params, name: str):
    """(our parameter, the view of it that checkpoint tensor `name` fills, the part of that
    tensor this rank takes), `_ELSEWHERE`, or None for a name the model does not know."""
    if name in params:
        return name, params[name], _own_part(model, name, params[name])
    if m := _EXPERT.match(name):
        return _expert_target(model, params, m.group(1), int(m.group(2)), m.group(3))
    if m := _STACKED.match(name):
        ours = f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
        if ours not in params:
            return None
        experts = model.get_submodule(m.group(1))
        return ours, params[ours], _rows(0, experts.first_expert, params[ours].shape[0])
    if m := _FUSED.match(name):
        fused, shard = _SHARD[m.group(2)]
        ours = f"{m.group(1)}.{fused}.{m.group(3)}"
        if ours in params:
            slices = model.get_submodule(f"{m.group(1)}.{fused}").shard_slices
            local_start = sum(s.length for s in slices[:shard])
            part = slices[shard]
            return (ours, params[ours].narrow(0, local_start, part.length),
                    _rows(0, part.start, part.length))
    return None


def _own_part(model, name: str, param: torch.Tensor):
    """How a parameter the checkpoint names directly is sliced for this rank: a column-
    parallel layer's rows (weight and bias), a row-parallel layer's or an embedding's
    `weight_shard`, else whole."""
    module_name, _, kind = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    slices = getattr(module, "shard_slices", None)
    if slices is not None and len(slices) == 1 and kind in ("weight", "bias"):
        return _rows(0, slices[0].start, slices[0].length)
    shard = getattr(module, "weight_shard", None)
    if shard is not None and kind == "weight":
        dim, start = shard
        return _rows(dim, start, param.shape[dim])
    return _whole


def _expert_target(model, params, prefix: str, expert: int, part: str):
    experts = model.get_submodule(prefix)
    local = expert - experts.first_expert
    name = f"{prefix}.w2" if part in ("w2", "down_proj") else f"{prefix}.w13"
    if name not in params or not 0 <= expert < experts.num_experts:
        return None
    if not 0 <= local < params[name].shape[0]:
        return _ELSEWHERE
    view = params[name][local]
    if part not in ("w2", "down_proj"):
        half = view.shape[0] // 2
        view = view.narrow(0, 0 if part in ("w1", "gate_proj") else half, half)
    return name, view, _whole


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
