"""Speculative decoding on the real model (SmolLM2-135M-Instruct, float32 CPU): n-gram
proposals on prompts whose answers repeat them and on a plain chat question, one batch, 48
tokens each with EOS ignored — token for token transformers' greedy output, with most
proposals accepted on the repetitive prompts. Skips when setup has not converted it."""

from __future__ import annotations

import pytest

from pdcluster.benchmarks.spec_decode_bench import REPETITIVE
from pdcluster.engine import LLM, SamplingParams
from tests.helpers import assert_pool_clean
from tests.real_model import chats

pytestmark = pytest.mark.slow
NUM_TOKENS = 48
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_ngram_speculation_matches_transformers(real_model_dir, real_reference):
    llm = LLM(real_model_dir, dtype="float32", device="cpu", num_kv_blocks=256,
              speculative="ngram:k=4")
    messages = [[{"role": "user", "content": text}] for text in REPETITIVE] + chats()[:1]
    prompts = [real_reference.chat_ids(m) for m in messages]
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == real_reference.greedy(prompt, NUM_TOKENS)
    stats = llm.engine.spec_decode_stats()
    assert stats.num_verifications > 0 and stats.acceptance_rate > 0.3, stats
    assert_pool_clean(llm.engine.block_pool)
