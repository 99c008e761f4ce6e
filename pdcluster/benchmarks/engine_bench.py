"""Engine benchmark: `pdcluster bench engine [--json] [--quick] [--threads N] [--device D]
[--model DIR|GGUF] [--speculative SPEC] [--host-tier]` (`--device cuda` without `--model`
measures random models of real shapes against the GPU's limits instead: benchmarks/gpu_bench.py,
`--shapes`, `--hf-shapes`; `--speculative ngram:k=4` measures decode tokens/s with and without
speculative decoding instead of the parts below:
benchmarks/spec_decode_bench.py; `--host-tier` measures the TTFT of prompts re-asked after the
device pool cycled, host tier and disk tier against recompute, instead:
benchmarks/host_tier_bench.py). The MoE and MLA studies are harnesses of the checkout:
`python -m benchmarks moe` and `python -m benchmarks mla`.

Measures, in one run, on `--model` (e.g. the built-in SmolLM2-135M-Instruct) or else on one
random model big enough that compute dominates on CPU (the `bench` preset of
`engine.models.tiny_model`: hidden 512, 8 layers, 8 heads / 4 KV heads, 32k vocab). Prompts are
random token ids either way (greedy, EOS ignored: the lengths are exact):

- throughput: output tokens/s of `LLM.generate` over N concurrent requests (prompt 256,
  output 64, EOS ignored) against transformers' `generate` run one request at a time (the
  baseline, on a subset of the same prompts: one at a time its rate does not depend on N);
- TTFT of a 2,048-token prompt whose first 90% is already in the prefix cache, against the same
  length uncached (median of 3 each, fresh random prompts);
- batch-1 decode step time, ours (`LLMEngine.step`) and transformers' (one forward with
  `past_key_values`), medians over the same number of steps.

Returns a flat dict; the CLI prints it as the last line of stdout. Torch is imported lazily so
the CLI's parser never loads it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class BenchSizes:
    num_requests: int = 32
    prompt_len: int = 256
    output_len: int = 64
    hf_requests: int = 4
    ttft_prompt_len: int = 2048
    cached_fraction: float = 0.9
    decode_steps: int = 32
    repeats: int = 3


QUICK = BenchSizes(
    num_requests=8,
    prompt_len=64,
    output_len=16,
    hf_requests=2,
    ttft_prompt_len=512,
    decode_steps=8,
    repeats=2,
)


_PROMPT_VOCAB = 32000  # ids drawn from [3, this): inside every supported model's vocabulary


def _prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(3, _PROMPT_VOCAB) for _ in range(length)] for _ in range(n)]


def run(args: argparse.Namespace) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK if args.quick else BenchSizes()
    device = getattr(args, "device", "cpu") or "cpu"
    if device == "cuda" and not getattr(args, "model", None):
        from pdcluster.benchmarks.gpu_bench import gpu_fields

        with tempfile.TemporaryDirectory(prefix="pdcluster-bench-") as tmp:
            return gpu_fields(args.shapes.split(","), args.hf_shapes.split(","), args.quick,
                              Path(tmp))
    with tempfile.TemporaryDirectory(prefix="pdcluster-bench-") as tmp:
        model_dir = _model_dir(getattr(args, "model", None), tmp)
        result = {
            "model": Path(model_dir).name if getattr(args, "model", None) else "bench-preset",
            "device": device,
            "threads": torch.get_num_threads(),
            **_model_facts(model_dir),
        }
        if getattr(args, "speculative", None):
            from pdcluster.benchmarks.spec_decode_bench import spec_fields

            result.update(spec_fields(model_dir, device, args.speculative, args.quick))
            return result
        if getattr(args, "host_tier", False):
            from pdcluster.benchmarks.host_tier_bench import host_tier_fields

            result.update(host_tier_fields(model_dir, device, args.quick))
            return result
        result.update(asdict(sizes))
        result.update(_throughput(model_dir, sizes, device))
        result.update(_ttft(model_dir, sizes, device))
        result.update(_decode_step(model_dir, sizes, device))
    return result


def _model_dir(model: str | None, tmp: str) -> str:
    """The model to measure: `model` (a folder, or a GGUF converted once), else a random one."""
    if model:
        from pdcluster.engine.models.gguf import resolve_model

        return resolve_model(model)
    from pdcluster.engine.models.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp, arch="llama", seed=0, preset="bench"))


def _model_facts(model_dir: str) -> dict:
    from pdcluster.engine.models.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model_dir)
    per_layer = (
        mc.hidden_size * mc.head_dim * (2 * mc.num_heads + 2 * mc.num_kv_heads)
        + 3 * mc.hidden_size * mc.intermediate_size
    )
    embeddings = 1 if mc.tie_word_embeddings else 2
    params = mc.num_layers * per_layer + embeddings * mc.vocab_size * mc.hidden_size
    return {
        "model_params_m": round(params / 1e6, 1),
        "model_hidden": mc.hidden_size,
        "model_layers": mc.num_layers,
    }


def _llm(model_dir: str, device: str, sizes: BenchSizes):
    from pdcluster.engine import LLM

    return LLM(
        model_dir,
        device=device,
        dtype="float32",
        max_num_seqs=sizes.num_requests,
        max_num_batched_tokens=2048,
    )


def _hf_model(model_dir: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _throughput(model_dir: str, sizes: BenchSizes, device: str) -> dict:
    import torch

    from pdcluster.engine import SamplingParams

    rng = random.Random(1)
    prompts = _prompts(sizes.num_requests, sizes.prompt_len, rng)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
    llm = _llm(model_dir, device, sizes)
    llm.generate(_prompts(2, sizes.prompt_len, rng), SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    ours_s = time.perf_counter() - start
    ours_tps = sum(len(o.token_ids) for o in outs) / ours_s
    del llm

    hf = _hf_model(model_dir, device)
    with torch.inference_mode():
        warm = torch.tensor([prompts[0][:16]], device=device)
        hf.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        for prompt in prompts[: sizes.hf_requests]:
            ids = torch.tensor([prompt], device=device)
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=sizes.output_len,
                do_sample=False,
            )
        _sync(device)
        hf_s = time.perf_counter() - start
    hf_tps = sizes.hf_requests * sizes.output_len / hf_s
    return {
        "ours_output_tokens_per_s": round(ours_tps, 1),
        "hf_output_tokens_per_s": round(hf_tps, 1),
        "throughput_ratio_vs_hf": round(ours_tps / hf_tps, 2),
    }


def _time_first_token(llm, prompt: list[int]) -> float:
    from pdcluster.engine import SamplingParams

    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    return time.perf_counter() - start


def _ttft(model_dir: str, sizes: BenchSizes, device: str) -> dict:
    rng = random.Random(2)
    llm = _llm(model_dir, device, sizes)
    n, cached = sizes.ttft_prompt_len, int(sizes.ttft_prompt_len * sizes.cached_fraction)
    _time_first_token(llm, _prompts(1, n, rng)[0])  # warm-up at full length
    uncached, hit = [], []
    for _ in range(sizes.repeats):
        uncached.append(_time_first_token(llm, _prompts(1, n, rng)[0]))
        prefix = _prompts(1, cached, rng)[0]
        _time_first_token(llm, prefix + _prompts(1, n - cached, rng)[0])  # fills the cache
        hit.append(_time_first_token(llm, prefix + _prompts(1, n - cached, rng)[0]))
    t_uncached, t_hit = statistics.median(uncached), statistics.median(hit)
    return {
        "ttft_ms_uncached": round(t_uncached * 1e3, 1),
        "ttft_ms_cached_90pct": round(t_hit * 1e3, 1),
        "ttft_ratio_cached_90pct": round(t_hit / t_uncached, 3),
    }


def _decode_step(model_dir: str, sizes: BenchSizes, device: str) -> dict:
    import torch

    from pdcluster.engine import SamplingParams

    rng = random.Random(3)
    prompt = _prompts(1, 64, rng)[0]
    llm = _llm(model_dir, device, sizes)
    engine = llm.engine
    engine.add_request(
        "decode",
        prompt,
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=sizes.decode_steps + 1),
    )
    engine.step()  # prefill
    ours = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        _sync(device)
        ours.append(time.perf_counter() - start)
    del llm

    hf = _hf_model(model_dir, device)
    theirs = []
    with torch.inference_mode():
        out = hf(torch.tensor([prompt], device=device), use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(sizes.decode_steps):
            start = time.perf_counter()
            out = hf(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            _sync(device)
            theirs.append(time.perf_counter() - start)
    return {
        "decode_step_ms_b1": round(statistics.median(ours) * 1e3, 2),
        "hf_decode_step_ms_b1": round(statistics.median(theirs) * 1e3, 2),
    }
