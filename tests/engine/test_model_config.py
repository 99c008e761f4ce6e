"""Parsing a Hugging Face config.json into `ModelConfig`, and loading a checkpoint's weights:
legacy and transformers-5 rope forms, architecture quirks, and clear errors for what the
engine cannot serve."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdcluster.engine import LLMEngine
from pdcluster.engine.models.loader import load_model
from pdcluster.engine.models.model_config import ModelConfig
from pdcluster.engine.models.rope import RotaryEmbedding
from pdcluster.engine.models.tiny_model import hf_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def as_rope_parameters(legacy: dict) -> dict:
    """The transformers-5 form of a legacy config: everything RoPE in `rope_parameters`."""
    cfg = copy.deepcopy(legacy)
    params = dict(cfg.pop("rope_scaling", None) or {})
    params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_theta"] = cfg.pop("rope_theta")
    cfg["rope_parameters"] = params
    return cfg


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"type": "linear", "factor": 2.0},  # the oldest spelling: "type", not "rope_type"
    {"rope_type": "linear", "factor": 2.0},
    LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
     "beta_fast": 16.0},
    {"rope_type": "yarn", "factor": 4.0},
], ids=["default", "linear-type", "linear", "llama3", "yarn", "yarn-implicit-original"])
def test_legacy_and_rope_parameters_parse_identically(rope_scaling) -> None:
    overrides = {"rope_theta": 500000.0}
    if rope_scaling:
        overrides["rope_scaling"] = copy.deepcopy(rope_scaling)
    legacy = hf_config("llama", **overrides)
    parsed = ModelConfig.from_hf(legacy)
    assert ModelConfig.from_hf(as_rope_parameters(legacy)) == parsed
    assert parsed.rope.theta == 500000.0
    expected_type = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
    assert parsed.rope.rope_type == (expected_type or "default")
    assert parsed.rope.factor == (rope_scaling or {}).get("factor")
    if parsed.rope.rope_type in ("llama3", "yarn"):
        expected = (rope_scaling or {}).get("original_max_position_embeddings", 2048)
        assert parsed.rope.original_max_position_embeddings == expected


def test_transformers_own_rope_parameters_match_the_legacy_parse() -> None:
    from transformers import LlamaConfig

    legacy = hf_config("llama", rope_theta=500000.0, rope_scaling=copy.deepcopy(LLAMA3))
    written = LlamaConfig(**copy.deepcopy(legacy)).to_dict()
    assert "rope_parameters" in written
    assert ModelConfig.from_hf(written) == ModelConfig.from_hf(legacy)


@pytest.mark.parametrize("rope_scaling", [
    None, {"rope_type": "linear", "factor": 2.0}, LLAMA3,
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256},
], ids=["default", "linear", "llama3", "yarn", "yarn-implicit-factor"])
def test_rope_table_values_do_not_depend_on_the_served_length(rope_scaling) -> None:
    """The engine builds tables for its max_model_len, which a user may cap below the model's
    limit: that must shorten the table, never change the frequencies."""
    extra = {"rope_scaling": copy.deepcopy(rope_scaling)} if rope_scaling else {}
    rope = ModelConfig.from_hf(hf_config("llama", **extra)).rope
    short, full = RotaryEmbedding(rope, 16, 300), RotaryEmbedding(rope, 16, 2048)
    assert torch.equal(short.cos, full.cos[:300]) and torch.equal(short.sin, full.sin[:300])


def test_implicit_yarn_factor_comes_from_the_model_context() -> None:
    yarn = {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256}
    assert ModelConfig.from_hf(hf_config("llama", rope_scaling=yarn)).rope.factor == 8.0


def test_rope_theta_defaults_to_10000() -> None:
    cfg = hf_config("llama")
    del cfg["rope_theta"]
    assert ModelConfig.from_hf(cfg).rope.theta == 10000.0


@pytest.mark.parametrize("attention_bias", [None, False, True])
def test_qwen2_always_has_qkv_bias_and_never_o_bias(attention_bias) -> None:
    extra = {} if attention_bias is None else {"attention_bias": attention_bias}
    qwen2 = ModelConfig.from_hf(hf_config("qwen2", **extra))
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    llama = ModelConfig.from_hf(hf_config("llama", **extra))
    assert llama.qkv_bias == llama.o_bias == bool(attention_bias)


def test_head_dim_is_derived_unless_given() -> None:
    derived = hf_config("llama", hidden_size=96, num_attention_heads=4)
    del derived["head_dim"]
    assert ModelConfig.from_hf(derived).head_dim == 24
    assert ModelConfig.from_hf({**derived, "head_dim": None}).head_dim == 24
    assert ModelConfig.from_hf({**derived, "head_dim": 32}).head_dim == 32


def test_num_kv_heads_defaults_to_num_heads() -> None:
    cfg = hf_config("llama")
    del cfg["num_key_value_heads"]
    assert ModelConfig.from_hf(cfg).num_kv_heads == cfg["num_attention_heads"] == 4


@pytest.mark.parametrize("overrides, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architectures"),
    ({"architectures": []}, "unsupported architectures"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "'dynamic' is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0],
                       "long_factor": [1.0]}}, "longrope"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "bogus": 1}}, "bogus"),
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_unservable_configs_raise_clear_errors(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(hf_config("llama", **overrides))


def test_mistral_sliding_window_caps_max_model_len() -> None:
    assert ModelConfig.from_hf(hf_config("mistral", sliding_window=128)).max_model_len == 128
    assert ModelConfig.from_hf(hf_config("mistral", sliding_window=None)).max_model_len == 2048
    assert ModelConfig.from_hf(hf_config("mistral", sliding_window=4096)).max_model_len == 2048
    # Qwen2 configs carry a window that is off unless use_sliding_window says otherwise.
    qwen2 = ModelConfig.from_hf(hf_config("qwen2", sliding_window=128))
    assert (qwen2.sliding_window, qwen2.max_model_len) == (None, 2048)
    on = ModelConfig.from_hf(hf_config("qwen2", sliding_window=128, use_sliding_window=True))
    assert on.max_model_len == 128


def test_eos_token_id_forms() -> None:
    assert ModelConfig.from_hf(hf_config("llama", eos_token_id=[2, 7])).eos_token_ids == (2, 7)
    assert ModelConfig.from_hf(hf_config("llama", eos_token_id=5)).eos_token_ids == (5,)
    assert ModelConfig.from_hf(hf_config("llama", eos_token_id=None)).eos_token_ids == ()


def test_missing_config_json(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError):
        LLMEngine.from_model(tmp_path, num_kv_blocks=4)


def rewrite_checkpoint(src: str, dst: Path, drop: tuple[str, ...] = (),
                       add: dict | None = None) -> Path:
    """A copy of the model folder's config and weights, minus `drop`, plus `add`."""
    dst.mkdir()
    shutil.copyfile(Path(src) / "config.json", dst / "config.json")
    weights = load_file(str(Path(src) / "model.safetensors"))
    for name in drop:
        del weights[name]
    weights.update(add or {})
    save_file(weights, str(dst / "model.safetensors"))
    return dst


def load(folder: Path):
    cfg = ModelConfig.from_pretrained(folder)
    return load_model(folder, cfg, torch.float32, torch.device("cpu"), 64)


@pytest.mark.parametrize("drop, message", [
    ((), None),
    (("model.layers.1.mlp.down_proj.weight",), "layers.1.mlp.down_proj.weight"),
    (("model.layers.0.self_attn.k_proj.weight",), "layers.0.self_attn.qkv_proj.weight"),
    (("model.layers.1.mlp.up_proj.weight",), "layers.1.mlp.gate_up_proj.weight"),
    (("lm_head.weight",), "lm_head.weight"),
    (("model.norm.weight",), "norm.weight"),
])
def test_checkpoint_missing_a_weight_is_rejected(model_dirs, tmp_path, drop, message) -> None:
    folder = rewrite_checkpoint(model_dirs["llama-gqa"], tmp_path / "model", drop)
    if message is None:
        assert load(folder).lm_head.weight.shape == (32000, 64)  # the control loads
        return
    with pytest.raises(ValueError, match="missing 1 weights") as info:
        load(folder)
    assert message in str(info.value)


def test_engine_refuses_an_incomplete_checkpoint(model_dirs, tmp_path) -> None:
    folder = rewrite_checkpoint(model_dirs["llama-gqa"], tmp_path / "model",
                                drop=("model.layers.0.self_attn.o_proj.weight",))
    with pytest.raises(ValueError, match="missing"):
        LLMEngine.from_model(folder, num_kv_blocks=4)


def test_unexpected_weight_is_rejected(model_dirs, tmp_path) -> None:
    folder = rewrite_checkpoint(model_dirs["llama-gqa"], tmp_path / "model",
                                add={"model.layers.0.self_attn.extra.weight": torch.ones(2)})
    with pytest.raises(ValueError, match="unexpected weight"):
        load(folder)


def test_tied_checkpoint_needs_no_lm_head(model_dirs) -> None:
    folder = Path(model_dirs["llama-yarn-tied"])
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"]
    model = load(folder)
    assert model.lm_head.weight is model.embed_tokens.weight
