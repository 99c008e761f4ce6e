"""The engine on a GPU: `pdcluster bench engine --device cuda [--shapes llama-1b,llama-8b]
[--quick] [--json]`.

On random-weight models of the named shapes (Llama-3.2-1B's and Llama-3.1-8B's by default;
on request Qwen3-30B-A3B's, an MoE, and DeepSeek-V2-Lite's, MLA with an MoE: only a
config.json is written, the engine draws its weights on the device, `load_format="dummy"`),
in bfloat16, measures in one run:

- the machine's ceilings: device copy rate (bytes read + written, a 1 GiB device-to-device
  copy) and bf16 matmul rate (8192^3);
- batch-1 decode ms/token (the median step of one request, scheduler and sampling included)
  and its ratio to the HBM floor: the weight bytes a step reads (of an MoE layer, the router
  and the experts the token picks; of an MLA layer, its low-rank projections) / the copy
  rate; the same step
  with the host and the GPU taking turns (`overlap_decode` off: no step launched ahead,
  engine/runner/lookahead.py); the device part alone (one replay of the batch-1 CUDA graph,
  timed with events), and the largest kernels of an eager step (torch's profiler);
- TTFT of a 2,048-token prompt (median of 3 fresh prompts) and its MFU: the step's FLOPs
  (2 x tokens x layer weights, the LM head for one row, causal attention) / the matmul rate;
- output tokens/s of 64 x (1,024 -> 128) and of 32 x (1,024 shared + 64) -> 64 through
  `LLM.generate`, and transformers' `generate` on the same ids with a model of the same shape
  (SDPA attention, batched, greedy), on the shapes listed in `--hf-shapes` (default: the 1B);
  with the steps of the 64-request run launched ahead and those taken.

Every figure is a ratio to something measured in the same run. Returns a flat dict.
`run_shape(..., device="cpu")` runs the same steps on the CPU (tests/test_gpu_bench.py, on a
tiny shape), so that a GPU's scarce minutes are not the first time this code runs.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                     vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     vocab_size=128256, tie_word_embeddings=False),
    # Qwen3-30B-A3B's shape: 128 experts, 8 per token; not in the default run (61 GB of
    # weights; `--shapes qwen3-30b-a3b`)
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                          rope_theta=1000000.0, rope_scaling=None),
    # DeepSeek-V2-Lite's shape: MLA (a 512-dim latent and a 64-dim RoPE key per token), 64
    # routed experts, 6 per token, 2 shared, the first layer dense (31 GB of weights;
    # `--shapes deepseek-v2-lite`)
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                             hidden_size=2048, intermediate_size=10944, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16,
                             kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408,
                             n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
                             first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy",
                             n_group=1, topk_group=1, norm_topk_prob=False,
                             routed_scaling_factor=1.0, scoring_func="softmax",
                             vocab_size=102400, tie_word_embeddings=False, rms_norm_eps=1e-6,
                             rope_theta=10000.0, max_position_embeddings=163840,
                             rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32,
                                           "beta_slow": 1, "mscale": 0.707,
                                           "mscale_all_dim": 0.707,
                                           "original_max_position_embeddings": 4096}),
}
_COMMON = dict(architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=131072, hidden_act="silu",
               torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192})


@dataclass(frozen=True, slots=True)
class GpuSizes:
    decode_steps: int = 128
    ttft_len: int = 2048
    repeats: int = 3
    batch: int = 64
    prompt_len: int = 1024
    output_len: int = 128
    shared_batch: int = 32
    shared_len: int = 1024
    shared_tail: int = 64
    shared_output: int = 64


QUICK = GpuSizes(decode_steps=32, repeats=2, batch=16, output_len=32, shared_batch=8,
                 shared_output=16)

# The engine's settings for every shape: one object, as vLLM's own defaults would set them.
ENGINE_SETTINGS = dict(device="cuda", dtype="bfloat16", load_format="dummy",
                       max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=8192,
                       block_size=16, enable_prefix_caching=True)


def write_shape(folder: Path, shape: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**_COMMON, **SHAPES[shape]}))
    return folder


def ceilings() -> dict:
    """Device copy rate (GB/s, read + written) and bf16 matmul rate (TFLOP/s), medians."""
    import torch

    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_s = median_time(lambda: a @ b, 20)
    return {"copy_gb_s": round(2 * src.numel() * 2 / copy_s / 1e9, 1),
            "matmul_tflops": round(2 * 8192**3 / mm_s / 1e12, 1)}


def median_time(fn, repeats: int) -> float:
    """Median seconds of `fn` on the current CUDA device (CUDA events), after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, 32000) for _ in range(length)] for _ in range(n)]


def _attention_weights(mc) -> int:
    """A layer's attention projections; of MLA: the query's (low-rank or full), the latent's
    down-projection, its up-projection to every head's keys and values, and the output."""
    m = mc.mla
    if m is None:
        return mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    query = (mc.hidden_size * mc.num_heads * qk if m.q_lora_rank is None else
             m.q_lora_rank * (mc.hidden_size + mc.num_heads * qk + 1))  # with its norm
    latent = mc.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    up = m.kv_lora_rank * mc.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
    return query + latent + up + mc.num_heads * m.v_head_dim * mc.hidden_size


def _layer_weights(mc, layer: int) -> int:
    """Weights of `layer` one token multiplies by: attention's projections, and the MLP (of an
    MoE layer: the router and the `top_k` experts the token picks, plus any shared one)."""
    attention = _attention_weights(mc)
    moe = mc.moe
    if moe is None or layer not in moe.moe_layers:
        return attention + 3 * mc.hidden_size * mc.intermediate_size
    experts = moe.top_k * moe.intermediate_size + moe.shared_intermediate_size
    return attention + moe.num_experts * mc.hidden_size + 3 * mc.hidden_size * experts


def weight_bytes_read(mc) -> int:
    """Bytes of weights a batch-1 decode step reads: every layer's (`_layer_weights`) and its
    two norms, the final norm and the LM head (the input embedding is one row per token
    unless it is the LM head too)."""
    layers = sum(_layer_weights(mc, layer) + 2 * mc.hidden_size
                 for layer in range(mc.num_layers))
    return 2 * (layers + mc.vocab_size * mc.hidden_size + mc.hidden_size)


def prefill_flops(mc, tokens: int) -> float:
    """2 per weight per token (`_layer_weights`), the LM head for one row, causal attention
    (MLA's prefill: per head, keys of its q/k width and values of `v_head_dim`)."""
    linear = (2 * tokens * sum(_layer_weights(mc, layer) for layer in range(mc.num_layers))
              + 2 * mc.vocab_size * mc.hidden_size)
    value_dim = mc.head_dim if mc.mla is None else mc.mla.v_head_dim
    attention = (2 * mc.num_layers * mc.num_heads * (mc.head_dim + value_dim)
                 * tokens * (tokens + 1) / 2)
    return linear + attention


def run_shape(shape: str, folder: Path, sizes: GpuSizes, limits: dict, with_hf: bool,
              device: str = "cuda") -> dict:
    import torch

    from pdcluster.engine import LLM
    from pdcluster.engine.models.model_config import ModelConfig

    model_dir = write_shape(folder / shape, shape)
    mc = ModelConfig.from_pretrained(str(model_dir))
    start = time.perf_counter()
    llm = LLM(str(model_dir), **{**ENGINE_SETTINGS, "device": device})
    out: dict[str, Any] = {"load_and_capture_s": round(time.perf_counter() - start, 1),
           "cuda_graphs": llm.engine.uses_cuda_graphs}
    rng = random.Random(0)
    step_s = _decode_step(llm, sizes, rng)
    floor_s = weight_bytes_read(mc) / (limits["copy_gb_s"] * 1e9)
    out.update(decode_ms=round(step_s * 1e3, 3), decode_floor_ms=round(floor_s * 1e3, 3),
               decode_vs_floor=round(step_s / floor_s, 3))
    llm.engine.overlap_decode = False  # the same step with host and GPU taking turns
    turns_s = _decode_step(llm, sizes, rng)
    llm.engine.overlap_decode = True
    out.update(decode_ms_without_overlap=round(turns_s * 1e3, 3),
               decode_overlap_speedup=round(turns_s / step_s, 3))
    graphs = llm.engine.runner.graphs
    if graphs is not None:  # the step's device part alone: the rest is the host's
        replay_s = graphs.replay_seconds(1)
        out.update(decode_replay_ms=round(replay_s * 1e3, 3),
                   decode_replay_vs_floor=round(replay_s / floor_s, 3))
    out["decode_kernels"], out["decode_device_ops_per_step"] = _decode_kernels(llm, rng, device)
    out["decode_device_ops_per_layer"] = round(out["decode_device_ops_per_step"]
                                               / mc.num_layers, 1)
    ttft = _ttft(llm, sizes, rng)
    out.update(ttft_2k_ms=round(ttft * 1e3, 2),
               ttft_2k_mfu=round(prefill_flops(mc, sizes.ttft_len) / ttft
                                 / (limits["matmul_tflops"] * 1e12), 3))
    batch_prompts = _prompts(sizes.batch, sizes.prompt_len, rng)
    ahead = llm.engine.runner.lookahead
    launched, taken = ahead.num_launched, ahead.num_taken
    out["batch_tok_s"] = round(_generate_rate(llm, batch_prompts, sizes.output_len), 1)
    out["batch_steps_launched_ahead"] = [ahead.num_launched - launched, ahead.num_taken - taken]
    shared = _prompts(1, sizes.shared_len, rng)[0]
    shared_prompts = [shared + tail for tail in _prompts(sizes.shared_batch, sizes.shared_tail,
                                                         rng)]
    out["shared_prefix_tok_s"] = round(_generate_rate(llm, shared_prompts,
                                                      sizes.shared_output), 1)
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    if with_hf:
        out.update(_hf_rates(model_dir, batch_prompts, sizes, shared_prompts, device))
        out["batch_vs_hf"] = round(out["batch_tok_s"] / out["hf_batch_tok_s"], 3)
        out["shared_prefix_vs_hf"] = round(out["shared_prefix_tok_s"]
                                           / out["hf_shared_prefix_tok_s"], 3)
    return out


def _decode_step(llm, sizes: GpuSizes, rng: random.Random) -> float:
    """Median `LLMEngine.step` of one request decoding (its prefill step excluded)."""
    from pdcluster.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=sizes.decode_steps + 1, ignore_eos=True)
    engine.add_request("decode", _prompts(1, 128, rng)[0], params)
    engine.step()  # the prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def _decode_kernels(llm, rng: random.Random, device: str,
                    steps: int = 4) -> tuple[list[list], int]:
    """Where a batch-1 decode step's device time goes: [kernel, us per step, launches per
    step] for the 12 largest, and how many device operations (kernels and copies) a step
    runs in all, from torch's profiler over eager steps (a graph replays the same kernels,
    without the launch gaps; tests/engine/test_gpu_path.py holds a layer to its budget). On
    the CPU: its operators and their CPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pdcluster.engine import SamplingParams

    engine, graphs = llm.engine, llm.engine.runner.graphs
    engine.runner.graphs = None
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 3, ignore_eos=True)
        engine.add_request("profiled", _prompts(1, 128, rng)[0], params)
        engine.step()
        engine.step()
        cuda = device == "cuda"
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
                     ) as prof:
            for _ in range(steps):
                engine.step()
            if cuda:
                torch.cuda.synchronize()
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.runner.graphs = graphs
    rows = [(e.key, e.self_device_time_total if cuda else e.self_cpu_time_total, e.count)
            for e in prof.key_averages()]
    rows = [row for row in rows if row[1] > 0]
    rows.sort(key=lambda row: -row[1])
    top = [[name[:60], round(us / steps, 1), count // steps] for name, us, count in rows[:12]]
    return top, sum(count for _, _, count in rows) // steps


def _ttft(llm, sizes: GpuSizes, rng: random.Random) -> float:
    from pdcluster.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(_prompts(1, sizes.ttft_len, rng), params)  # warm-up
    times = []
    for prompt in _prompts(sizes.repeats, sizes.ttft_len, rng):
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _generate_rate(llm, prompts: list[list[int]], output_len: int) -> float:
    from pdcluster.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == output_len for o in outs)
    return len(prompts) * output_len / elapsed


def _hf_rates(model_dir: Path, prompts, sizes: GpuSizes, shared_prompts, device: str) -> dict:
    """transformers' batched greedy `generate` on the same ids, a random model of the shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def rate(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device=device)
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4,
                       do_sample=False)
        sync()
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
        sync()
        assert out.shape[1] == ids.shape[1] + new
        return len(batch) * new / (time.perf_counter() - start)

    with torch.inference_mode():
        result = {"hf_batch_tok_s": round(rate(prompts, sizes.output_len), 1),
                  "hf_shared_prefix_tok_s": round(rate(shared_prompts, sizes.shared_output), 1)}
    return result


def gpu_fields(shapes: list[str], hf_shapes: list[str], quick: bool, folder: Path) -> dict:
    import torch

    hf_shapes = [shape for shape in hf_shapes if shape]  # "" (--hf-shapes ''): none
    unknown = sorted((set(shapes) | set(hf_shapes)) - set(SHAPES))
    if unknown:
        raise ValueError(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    sizes = QUICK if quick else GpuSizes()
    limits = ceilings()
    result: dict = {"gpu": torch.cuda.get_device_name(), **limits,
                    "engine_settings": ENGINE_SETTINGS}
    for shape in shapes:
        fields = run_shape(shape, folder, sizes, limits, shape in hf_shapes)
        result.update({f"{shape}.{k}": v for k, v in fields.items()})
    return result
