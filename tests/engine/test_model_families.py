"""Picking the implementation from `architectures`, the family config sections (MoE routing,
MLA), and the MoE layers against straightforward per-token references."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from pdcluster.engine.models.model_families import MoEConfig
from pdcluster.engine.models.moe import Experts, Router
from pdcluster.engine.models.registry import model_class
from pdcluster.engine.models.tiny_model import hf_config


def test_every_supported_architecture_has_an_implementation() -> None:
    for arch in SUPPORTED_ARCHITECTURES:
        assert isinstance(model_class(arch), type)


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], ["Gemma3ForCausalLM"], []])
def test_unsupported_architecture_lists_what_is_supported(archs) -> None:
    with pytest.raises(ValueError, match="unsupported architectures") as err:
        ModelConfig.from_hf(hf_config("llama", architectures=archs))
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM"):
        model_class("GPT2LMHeadModel")


def test_unsupported_model_folder_fails_before_loading(tmp_path) -> None:
    import json

    from pdcluster.engine import LLMEngine

    config = hf_config("llama", architectures=["FalconForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM.*supported: LlamaForCausalLM"):
        LLMEngine.from_model(tmp_path, num_kv_blocks=4)


def test_moe_and_mla_sections_parse() -> None:
    from tests.hf_tiny import _BASE, _CLASSES, HF_VARIANTS

    def parse(name):
        spec = dict(HF_VARIANTS[name])
        arch = spec.pop("arch")
        return ModelConfig.from_hf({**_BASE, **spec, "architectures": [_CLASSES[arch][1]]})

    q3 = parse("qwen3moe-8x3-norm-dense0")
    assert q3.qk_norm and q3.moe.moe_layers == (1,) and q3.moe.top_k == 3 and q3.mla is None
    v2 = parse("deepseek-v2-qlora-grouped")
    assert v2.moe.num_groups == 4 and v2.moe.shared_intermediate_size == 32
    assert v2.mla.q_lora_rank == 24 and v2.kv_layout == (1, 1, 16 + 8)
    v3 = parse("deepseek-v3-yarn-shared2")
    assert v3.moe.scoring == "sigmoid" and v3.moe.score_bias and v3.mla.q_lora_rank is None
    assert parse("qwen3-headdim").kv_layout == (2, 2, 32)


def _reference_moe(x, router, experts, cfg):
    """Per-token loop: what the grouped computation must equal."""
    ids, weights = router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t], strict=True):
            gate, up = (experts.w13[e] @ x[t]).split(cfg.intermediate_size)
            out[t] += w * (experts.w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("cfg", [
    MoEConfig(4, 2, 8, (0,)),
    MoEConfig(8, 3, 8, (0,), norm_topk_prob=False, num_groups=4, topk_groups=2,
              routed_scaling_factor=1.5),
    MoEConfig(8, 2, 8, (0,), scoring="sigmoid", num_groups=2, topk_groups=1,
              group_score="top2_sum", score_bias=True, routed_scaling_factor=2.5),
])
def test_grouped_experts_equal_a_per_token_loop(cfg) -> None:
    torch.manual_seed(0)
    router, experts = Router(cfg, 16), Experts(cfg.num_experts, 16, cfg.intermediate_size)
    for p in [*router.parameters(), *experts.parameters()]:
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(23, 16)
    ids, weights = router(x)
    assert ids.shape == weights.shape == (23, cfg.top_k)
    if cfg.num_groups > 1:  # every pick lies in one of the kept groups
        groups = ids // (cfg.num_experts // cfg.num_groups)
        assert all(len(set(row.tolist())) <= cfg.topk_groups for row in groups)
    torch.testing.assert_close(experts(x, ids, weights), _reference_moe(x, router, experts, cfg))


def _rewrite(src: str, dst, transform) -> str:
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = transform(load_file(Path(src) / "model.safetensors"))
    save_file(weights, str(Path(dst) / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _stack_experts(weights: dict) -> dict:
    """Mixtral's per-expert w1/w3/w2 -> transformers-5's stacked gate_up_proj/down_proj."""
    out = {k: v for k, v in weights.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.block_sparse_moe.experts."
        w = {n: [weights[f"{p}{e}.{n}.weight"] for e in range(4)] for n in ("w1", "w2", "w3")}
        stacked = f"model.layers.{layer}.mlp.experts."
        out[stacked + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w["w1"], w["w3"], strict=True)])
        out[stacked + "down_proj"] = torch.stack(w["w2"])
    return out


def _load(folder: str):
    from pdcluster.engine.models.loader import load_model

    cfg = ModelConfig.from_pretrained(folder)
    return load_model(folder, cfg, torch.float32, torch.device("cpu"), 64)


def test_stacked_and_per_expert_checkpoints_load_the_same(model_dirs, tmp_path) -> None:
    per_expert = _load(model_dirs["mixtral-4x2"])
    stacked = _load(_rewrite(model_dirs["mixtral-4x2"], tmp_path / "m", _stack_experts))
    for (name, a), (_, b) in zip(per_expert.named_parameters(), stacked.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name
    experts = per_expert.layers[1].mlp.experts
    assert experts.w13.shape == (4, 2 * 96, 64) and experts.w2.shape == (4, 64, 96)


def test_checkpoint_missing_an_expert_weight_is_rejected(model_dirs, tmp_path) -> None:
    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    folder = _rewrite(model_dirs["mixtral-4x2"], tmp_path / "m",
                      lambda w: {k: v for k, v in w.items() if k != gone})
    with pytest.raises(ValueError, match=r"missing 1 weights.*layers\.1\.mlp\.experts\.w13"):
        _load(folder)


def test_mla_latent_plane_is_one_contiguous_range_per_block() -> None:
    from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

    spec = KVCacheSpec(3, 2, 4, 1, 6, 4, num_planes=1)
    assert spec.block_nbytes == 2 * 4 * 6 * 4  # layers x slots x (latent + rope key), float32
    cache = PagedKVCache(spec, torch.float32, torch.device("cpu"))
    entries = torch.arange(12.0).view(2, 6)
    rows = cache.slot_rows(torch.tensor([1, 1]), torch.tensor([2, 3]))
    cache.write_latent(1, rows, entries)
    assert torch.equal(cache.layer_latent(1)[1, 2:4, 0], entries)
    flat = cache.tensor.view(-1)
    start = spec.block_range(1)[0] // 4 + (1 * 4 + 2) * 6  # block 1, layer 1, slot 2
    assert torch.equal(flat[start : start + 12], entries.view(-1))
    assert cache.tensor[[0, 2]].abs().sum() == 0 and cache.layer_latent(0).abs().sum() == 0
