"""Tiny random model variants and prompt factories shared by engine, transfer and node tests.
Torch is imported lazily so torch-free test rooms can collect without it."""

from __future__ import annotations

import os
import random

from tests.hf_tiny import HF_VARIANTS, build_hf_model

# The SentencePiece file of the tiny models' tokenizer, where mistral-common (which ships it) is
# not installed: the GPU machine's image (scripts/gpu_check.sh carries the file).
TOKENIZER_ENV = "PDCLUSTER_TEST_SENTENCEPIECE"

# Variants cover: GQA ratios (MHA, GQA, MQA), head_dim != hidden/heads, rope_theta, the
# supported rope_scaling types, tied embeddings and Qwen2's qkv bias; the families built by
# transformers itself (tests/hf_tiny.py): Qwen3, MoE (expert counts, top-k, renormalised or not,
# dense layers), DeepSeek MLA (q/kv ranks, rope dims, V2/V3 routing, shared experts, yarn).
MODEL_VARIANTS = {
    "llama-gqa": {"arch": "llama"},
    "llama-mqa-headdim-llama3rope": {
        "arch": "llama", "hidden_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    "qwen2-tied-bias-mha": {"arch": "qwen2", "num_key_value_heads": 4, "rope_theta": 1000000.0},
    "mistral-linear-rope": {"arch": "mistral", "num_attention_heads": 8,
                            "num_key_value_heads": 2,
                            "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama-yarn-tied": {"arch": "llama", "tie_word_embeddings": True, "num_hidden_layers": 3,
                        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                         "original_max_position_embeddings": 256}},
    # vLLM's CPU attention kernels take head sizes of 32 and up (tests/vllm_backend).
    "llama-vllm": {"arch": "llama", "hidden_size": 128, "num_attention_heads": 4,
                   "num_key_value_heads": 2},
}


MODEL_VARIANTS.update(HF_VARIANTS)


class ModelDirs(dict):
    """Model folders by variant name, each built on first use (a suite that needs one model
    doesn't build them all)."""

    def __init__(self, root) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> str:
        from pdcluster.engine.models.tiny_model import make_tiny_model

        spec = dict(MODEL_VARIANTS[name])
        seed = list(MODEL_VARIANTS).index(name)
        arch = spec.pop("arch")
        if name in HF_VARIANTS:
            path = build_hf_model(self.root / name, arch, seed, **spec)
        else:
            path = make_tiny_model(self.root / name, arch=arch, seed=seed,
                                   sentencepiece=os.environ.get(TOKENIZER_ENV), **spec)
        self[name] = str(path)
        return self[name]


def build_model_dirs(root) -> ModelDirs:
    return ModelDirs(root)


def make_hf_reference():
    """hf_reference(model_dir, prompt_ids, max_new_tokens) -> greedy continuation (no EOS stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    models, memo = {}, {}

    def generate(model_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (model_dir, tuple(prompt), max_new_tokens)
        if key not in memo:
            if model_dir not in models:
                m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
                m.generation_config.eos_token_id = None
                models[model_dir] = m
            ids = torch.tensor([prompt])
            out = models[model_dir].generate(ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=max_new_tokens, do_sample=False)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return generate


def random_prompts(n: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(n)]
