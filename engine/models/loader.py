"""Load a Hugging Face checkpoint folder (`config.json` + `*.safetensors`, sharded or not)
into `CausalLM`, fusing q/k/v and gate/up weights as they stream in."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.models.llama import CausalLM
from engine.models.rope import RotaryEmbedding

logger = logging.getLogger(__name__)

# checkpoint name -> (our parameter, shard index within the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def load_model(path: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> CausalLM:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {path}")
    with torch.device("meta"):
        model = CausalLM(cfg, max_positions)
    model.to_empty(device=device)
    # RoPE tables are buffers computed from config, not weights: rebuild them on the device.
    rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions).to(device)
    for layer in model.layers:
        layer.self_attn.rope = rope
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                _load_tensor(model, cfg, params, name, f.get_tensor(name), loaded)
    _check_complete(model, cfg, params, loaded)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(dtype=dtype).eval()


def _load_tensor(model, cfg, params, name, tensor, loaded) -> None:
    if _IGNORED.search(name):
        return
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return
    m = _LAYER_NAME.match(name)
    target, shard = name, None
    if m and m.group(2) in _FUSED:
        fused, shard = _FUSED[m.group(2)]
        target = f"model.layers.{m.group(1)}.{fused}.{m.group(3)}"
    our_name = _our_name(target)
    if our_name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    target_view = _shard_view(params[our_name], model, cfg, our_name, shard)
    if target_view.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies "
                         f"{tuple(target_view.shape)}")
    with torch.no_grad():
        target_view.copy_(tensor)
    loaded.add(f"{our_name}#{shard}")


def _our_name(hf_name: str) -> str:
    return hf_name.removeprefix("model.")


def _shard_view(param: torch.Tensor, model, cfg: ModelConfig, name: str, shard: int | None):
    if shard is None:
        return param
    if "qkv_proj" in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:shard])
    return param.narrow(0, start, sizes[shard])


def _check_complete(model, cfg, params, loaded: set[str]) -> None:
    expected = set()
    for name in params:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        shards = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else None
        expected |= {f"{name}#{i}" for i in range(shards)} if shards else {f"{name}#None"}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
