"""The real model (SmolLM2-135M-Instruct, float32 CPU), token for token: pdcluster's greedy
tokens equal transformers' for chat-templated prompts, 64 tokens each with EOS ignored, run
as one batch; and it answers a factual question. Skips when setup has not converted it."""

from __future__ import annotations

import pytest

from pdcluster.engine import SamplingParams
from tests.helpers import assert_pool_clean
from tests.real_model import MAX_TOKENS, QUESTIONS, chats

pytestmark = pytest.mark.slow
GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_chat_prompts_match_transformers(real_llm, real_reference):
    prompts = [real_reference.chat_ids(chat) for chat in chats()]
    outs = real_llm.generate(prompts, GREEDY_64)
    for question, prompt, out in zip(QUESTIONS, prompts, outs, strict=True):
        assert len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == real_reference.greedy(prompt), f"diverged on {question!r}"
    assert_pool_clean(real_llm.engine.block_pool)


def test_chat_with_system_prompt_matches_transformers(real_llm, real_reference):
    chat = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": QUESTIONS[0]}]
    prompt = real_reference.chat_ids(chat)
    out = real_llm.generate([prompt], GREEDY_64)[0]
    assert out.token_ids == real_reference.greedy(prompt)


def test_answers_a_factual_question(real_llm, real_reference):
    prompt = real_reference.chat_ids(chats()[0][-1:])
    out = real_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"
