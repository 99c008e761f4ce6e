"""Build a small random-weight model folder in Hugging Face format, with a real tokenizer.

`make_tiny_model(out_dir, arch=..., seed=..., preset=...)` writes `config.json`,
`generation_config.json`, `model.safetensors` and tokenizer files. The tokenizer is the
32,000-token Llama-2-style SentencePiece model shipped inside the `mistral-common` package, so
nothing is downloaded. Weights are random: the model's text is gibberish, but it exercises every
code path of a real checkpoint (and `transformers` loads it, which the tests use as reference).

Weights are drawn wider than a trained model's (std 0.1 rather than 0.02) so greedy decoding has
clear margins between the top two logits, which makes token-exact comparisons meaningful.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ARCHS = ("llama", "qwen2", "mistral")
PRESETS = ("tiny", "bench")

_HF_NAMES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "mistral": ("MistralForCausalLM", "mistral"),
}
_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048),
    "bench": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096),
}
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}<<SYS>>\n{{ message['content'] }}\n<</SYS>>\n\n"
    "{% elif message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %} {{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
VOCAB_SIZE = 32000
BOS_ID, EOS_ID = 1, 2


def hf_config(arch: str, preset: str = "tiny", **overrides: Any) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}")
    architecture, model_type = _HF_NAMES[arch]
    cfg: dict[str, Any] = dict(
        architectures=[architecture], model_type=model_type, vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
        tie_word_embeddings=arch == "qwen2", bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        torch_dtype="float32", initializer_range=0.02,
    )
    if arch == "mistral":
        cfg["sliding_window"] = None
    cfg.update(_PRESETS[preset])
    cfg.update(overrides)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def random_weights(cfg: dict[str, Any], seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0, scale: float = std) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale + mean

    hidden, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    w = {"model.embed_tokens.weight": normal(cfg["vocab_size"], hidden, scale=1.0),
         "model.norm.weight": normal(hidden, mean=1.0)}
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = normal(cfg["vocab_size"], hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in (("q", (q_out, hidden)), ("k", (kv_out, hidden)),
                            ("v", (kv_out, hidden)), ("o", (hidden, q_out))):
            w[f"{p}self_attn.{name}_proj.weight"] = normal(*shape)
            if qkv_bias and name != "o":
                w[f"{p}self_attn.{name}_proj.bias"] = normal(shape[0])
        w[f"{p}mlp.gate_proj.weight"] = normal(inter, hidden)
        w[f"{p}mlp.up_proj.weight"] = normal(inter, hidden)
        w[f"{p}mlp.down_proj.weight"] = normal(hidden, inter)
        w[f"{p}input_layernorm.weight"] = normal(hidden, mean=1.0)
        w[f"{p}post_attention_layernorm.weight"] = normal(hidden, mean=1.0)
    return {k: v.contiguous() for k, v in w.items()}


def make_tiny_model(out_dir: str | Path, arch: str = "llama", seed: int = 0,
                    preset: str = "tiny", sentencepiece: str | Path | None = None,
                    **overrides: Any) -> Path:
    """Write a random model folder and return its path. `overrides` patch config.json;
    `sentencepiece` names the tokenizer's SentencePiece file (default: mistral-common's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(arch, preset, **overrides)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, indent=2))
    save_file(random_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(out, cfg["max_position_embeddings"], sentencepiece)
    return out


def write_tokenizer(out: Path, max_len: int, sentencepiece: str | Path | None = None) -> None:
    """Copy the SentencePiece model (mistral-common's packaged one unless `sentencepiece`
    names another) and write the HF tokenizer config around it, then let transformers add the
    fast `tokenizer.json` next to it."""
    from transformers import AutoTokenizer

    if sentencepiece is None:
        import mistral_common

        sentencepiece = Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1"
    shutil.copyfile(sentencepiece, out / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_len, "chat_template": _CHAT_TEMPLATE, "legacy": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(out).save_pretrained(out)
