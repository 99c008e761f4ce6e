"""Tensor parallelism on CPU (gloo over 127.0.0.1; engine/runner/tp_workers.py): two ranks give
transformers' greedy tokens exactly — and so TP=1's — on every family's split (KV heads split,
one KV head replicated, q/k/v bias, tied embeddings, Qwen3's q/k norms, routed experts split,
MLA's latent replicated), through chunked prefill, prefix hits and preemption (the host and disk
tiers: test_tp_kv_tiers.py); a rank that dies fails the next step at once with its name; what TP
cannot do yet is refused by name.

Kept small: every engine here starts a second process that imports torch and loads its slice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.runner.tp_workers import TensorParallelError
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _tp2(model: str, **options) -> LLM:
    return LLM(model, device="cpu", dtype="float32", tensor_parallel_size=2, **options)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-tied-bias-mha",
                                     "llama-mqa-headdim-llama3rope", "qwen3-headdim",
                                     "mixtral-4x2", "deepseek-v2-qlora-grouped"])
def test_two_ranks_match_transformers(variant, model_dirs, hf_reference):
    """Chunked prefill (a 16-token budget) and prefix hits (two prompts sharing 3 blocks)."""
    model = model_dirs[variant]
    llm = _tp2(model, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    try:
        prefix = random_prompts(1, 13, 13, seed=31)[0]
        prompts = random_prompts(2, 5, 30, seed=32) + [prefix + [9, 8], prefix + [7]]
        outs = llm.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_reference(model, prompt, GREEDY.max_tokens)
        assert outs[-1].num_cached_tokens >= 12
        assert_pool_clean(llm.engine.block_pool)
    finally:
        llm.engine.close()


def test_preemption_under_a_tiny_pool_keeps_the_tokens(model_dirs, hf_reference):
    model = model_dirs["llama-gqa"]
    llm = _tp2(model, num_kv_blocks=12, block_size=4)
    try:
        prompts = random_prompts(4, 10, 14, seed=33)
        for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
            assert out.token_ids == hf_reference(model, prompt, GREEDY.max_tokens)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_pool_clean(llm.engine.block_pool)
    finally:
        llm.engine.close()


def test_a_rank_that_dies_fails_the_next_step_at_once(model_dirs):
    llm = _tp2(model_dirs["llama-gqa"], num_kv_blocks=32)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
        worker = llm.engine.runner.peers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=10)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2, temperature=0.0))
        assert time.monotonic() - started < 10
    finally:
        llm.engine.close()


def test_what_tensor_parallelism_cannot_do_yet_is_refused_by_name(model_dirs):
    with pytest.raises(ValueError, match="is not divisible by tensor_parallel_size 3"):
        LLM(model_dirs["qwen2-tied-bias-mha"], device="cpu", tensor_parallel_size=3)


def test_generate_cli_takes_the_tensor_parallel_size(model_dirs):
    done = subprocess.run(
        [sys.executable, "-m", "pdcluster.cluster.cli", "generate", "--model",
         model_dirs["llama-gqa"], "--prompt-ids", "5,6,7,8", "--max-tokens", "4",
         "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "generated 4 tokens" in done.stderr


def test_bench_tp_reports_each_figure_against_tp1():
    done = subprocess.run([sys.executable, "-m", "pdcluster.cluster.cli", "bench", "tp",
                           "--quick", "--json"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"] is True
    for name in ("decode_b1", "decode_b16", "ttft_512"):
        assert result[f"tp2_over_tp1_{name}"] > 0
    assert result["allreduce_us_p50"] > 0 and result["allreduce_us_mean"] > 0  # the ceiling
