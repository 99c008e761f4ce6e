"""`python -m benchmarks mla [--quick]`: MLA decode on CPU, absorbed vs expanded, and KV bytes
(a study behind docs/engine.md's choice of the absorbed form).

One DeepSeek-V2-Lite-shaped attention layer (hidden 2048, 16 heads, kv_lora_rank 512,
qk_nope 128, qk_rope 64, v 128; random weights) decodes batches of 1 and 8 sequences over a
paged latent cache of 512 and 2,048 tokens each, in the absorbed form (queries folded through
`kv_b_proj`'s key half, attention over the cached latents as one shared head) and in the
expanded form (every context latent expanded to per-head keys and values each step, as in
prefill), medians of several steps. The engine decodes in the absorbed form.

The absorbed form's attention over the latents, alone, two ways on the same queries: the
engine's paged decode kernel reading the latent cache in place (engine/kernels, the C++ op on
CPU: every head a row of the one latent KV head, the entries the keys and their latent the
values) against gathering each sequence's entries and attending with matmuls under a mask
(what the engine does without its kernels); with their largest difference.

KV bytes per token (all layers, bf16 as served) come from `KVCacheSpec`, for DeepSeek-V2-Lite
(27 layers) against an equal dense model: the same layers and 16 heads as MHA with
head_dim 128 (what an MLA-less V2-Lite would cache), and for DeepSeek-V3 (61 layers, 128 heads).
"""

from __future__ import annotations

import argparse
import statistics
import time

HIDDEN, HEADS, RANK, NOPE, ROPE, V = 2048, 16, 512, 128, 64, 128
BLOCK = 16


def _layer():
    import torch

    from pdcluster.engine.models.model_config import ModelConfig

    hf = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 32, "hidden_size": HIDDEN,
          "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": HEADS,
          "q_lora_rank": None, "kv_lora_rank": RANK, "qk_nope_head_dim": NOPE,
          "qk_rope_head_dim": ROPE, "v_head_dim": V, "n_routed_experts": 2,
          "num_experts_per_tok": 1, "moe_intermediate_size": 8, "max_position_embeddings": 4096}
    cfg = ModelConfig.from_hf(hf)
    from pdcluster.engine.models.mla import MLAttention
    from pdcluster.engine.models.rope import RotaryEmbedding

    torch.manual_seed(0)
    layer = MLAttention(cfg, 0, RotaryEmbedding(cfg.rope, ROPE, 4096))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return layer


def _decode_meta(batch: int, context: int):
    import torch

    from pdcluster.engine.models.attention_meta import AttentionMetadata, GatherWorkspace

    blocks = context // BLOCK
    table = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), blocks * BLOCK)
    slot_rows = table[:, -1] * BLOCK + BLOCK - 1  # one layer, one plane: row = block*bs + off
    return AttentionMetadata(slot_rows, batch, table, lens, [], GatherWorkspace())


def _time(layer, cache, meta, batch: int, context: int, steps: int) -> dict[bool, float]:
    """Median step seconds of each form; the two alternate so they share the machine's noise."""
    import torch

    x = torch.randn(batch, HIDDEN)
    positions = torch.full((batch,), context - 1)
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for _ in range(steps + 1):
            for absorb in (True, False):
                layer.absorb_decode = absorb
                start = time.perf_counter()
                layer(x, positions, cache, meta)
                times[absorb].append(time.perf_counter() - start)
    return {absorb: statistics.median(t[1:]) for absorb, t in times.items()}


def absorbed_vs_expanded(steps: int = 5) -> dict:
    import torch

    from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

    layer = _layer()
    result = {}
    for batch, context in ((1, 512), (1, 2048), (8, 512), (8, 2048)):
        spec = KVCacheSpec(batch * context // BLOCK, 1, BLOCK, 1, RANK + ROPE, 4, num_planes=1)
        cache = PagedKVCache(spec, torch.float32, torch.device("cpu"))
        cache.tensor.normal_()
        meta = _decode_meta(batch, context)
        timings = _time(layer, cache, meta, batch, context, steps)
        key = f"b{batch}_ctx{context}"
        result[f"mla_decode_ms_absorbed_{key}"] = round(timings[True] * 1e3, 2)
        result[f"mla_decode_ms_expanded_{key}"] = round(timings[False] * 1e3, 2)
        result[f"mla_absorbed_speedup_{key}"] = round(timings[False] / timings[True], 2)
    return result


def kernel_vs_gather(steps: int = 5) -> dict:
    """The absorbed attention over the latents: the kernel in place against gather + matmuls
    (medians, alternating; their largest difference)."""
    from pdcluster.engine import kernels

    ops = kernels.ops()
    if ops is None:
        return {"mla_kernel": "the engine's C++ kernels are not built (python -m "
                              "pdcluster.engine.kernels)"}
    layer, result = _layer(), {}
    for batch, context in ((1, 512), (1, 2048), (8, 512), (8, 2048)):
        key = f"b{batch}_ctx{context}"
        kernel, gather, diff = _latent_attention_times(ops, layer, batch, context, steps)
        result[f"mla_attention_ms_kernel_{key}"] = round(kernel * 1e3, 3)
        result[f"mla_attention_ms_gather_{key}"] = round(gather * 1e3, 3)
        result[f"mla_kernel_speedup_{key}"] = round(gather / kernel, 2)
        result[f"mla_kernel_max_diff_{key}"] = diff
    return result


def _latent_attention_times(ops, layer, batch: int, context: int, steps: int
                            ) -> tuple[float, float, float]:
    import torch

    from pdcluster.engine.kv.kv_cache import KVCacheSpec, PagedKVCache

    spec = KVCacheSpec(batch * context // BLOCK, 1, BLOCK, 1, RANK + ROPE, 4, num_planes=1)
    cache = PagedKVCache(spec, torch.float32, torch.device("cpu"))
    cache.tensor.normal_()
    entries, meta = cache.layer_latent(0), _decode_meta(batch, context)
    queries = torch.randn(batch, HEADS, RANK + ROPE)

    def kernel():
        return ops.paged_attention(queries.unsqueeze(1), entries, entries[..., :RANK],
                                   meta.decode_block_table, meta.decode_lens,
                                   layer.scale)[0].squeeze(1)

    def gather():
        return layer._gathered_latent_attention(queries, entries, meta)

    times: dict[str, list[float]] = {"kernel": [], "gather": []}
    outs = {}
    for _ in range(steps + 1):
        for way, fn in (("kernel", kernel), ("gather", gather)):
            start = time.perf_counter()
            outs[way] = fn()
            times[way].append(time.perf_counter() - start)
    kernel_s, gather_s = (statistics.median(times[way][1:]) for way in ("kernel", "gather"))
    return kernel_s, gather_s, float((outs["kernel"] - outs["gather"]).abs().max())


def kv_bytes_per_token() -> dict:
    from pdcluster.engine.kv.kv_cache import KVCacheSpec

    def per_token(layers: int, heads: int, dim: int, planes: int) -> int:
        return KVCacheSpec(1, layers, BLOCK, heads, dim, 2, planes).block_nbytes // BLOCK

    lite_mla, lite_dense = per_token(27, 1, RANK + ROPE, 1), per_token(27, 16, 128, 2)
    v3_mla, v3_dense = per_token(61, 1, RANK + ROPE, 1), per_token(61, 128, 128, 2)
    return {"kv_bytes_per_token_v2lite_mla": lite_mla,
            "kv_bytes_per_token_v2lite_dense_mha": lite_dense,
            "kv_dense_over_mla_v2lite": round(lite_dense / lite_mla, 2),
            "kv_bytes_per_token_v3_mla": v3_mla, "kv_bytes_per_token_v3_dense_mha": v3_dense,
            "kv_dense_over_mla_v3": round(v3_dense / v3_mla, 2)}


def mla_fields(steps: int) -> dict:
    return {**absorbed_vs_expanded(steps), **kernel_vs_gather(steps), **kv_bytes_per_token()}


def run(args: argparse.Namespace) -> dict:
    """Medians over the engine bench's number of steps (7; --quick 5)."""
    return mla_fields(5 if args.quick else 7)
