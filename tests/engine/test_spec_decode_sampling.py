"""Speculative sampling draws from the target's exact distribution: a model with an 8-token
vocabulary, n-gram proposals (every token is in the prompt, so every step proposes), 3,000
samples of 3 tokens at temperature 1 (token 2 is verified against a proposal; token 3 is the
bonus after an acceptance, or plain decoding after a rejection). The joint distribution of
tokens 2 and 3 is compared with the exact one computed with transformers by a chi-square
goodness-of-fit test at significance 0.001 (fixed seeds: the outcome is deterministic)."""

from __future__ import annotations

import math
from collections import Counter

from pdcluster.engine import LLM, SamplingParams
from tests.helpers import assert_pool_clean
from tests.hf_tiny import build_hf_model

VOCAB = 8
PROMPT = [1, 2, 3, 4, 5, 6, 7, 0, 3, 4]  # every token occurs: a 1-gram always matches
NUM_SAMPLES = 3000


def exact_joint_of_tokens_2_and_3(model_dir) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([PROMPT + p for p in prefixes])).logits[:, -1]
        return torch.softmax(logits.double(), dim=-1)

    p1 = next_probs([[]])[0]
    p2 = next_probs([[a] for a in range(VOCAB)])  # [a, b]
    p3 = next_probs([[a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB,
                                                                               VOCAB)
    joint = (p1[:, None, None] * p2[:, :, None] * p3).sum(0)  # [b, c]
    return joint.tolist()


def chi_square_critical(df: int, z: float = 3.090) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.090: alpha 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: Counter, expected: list[list[float]], n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom; cells expected below 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for b in range(VOCAB):
        for c in range(VOCAB):
            e, o = expected[b][c] * n, counts[(b, c)]
            if e < 5:
                pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            else:
                stat, cells = stat + (o - e) ** 2 / e, cells + 1
    if pooled_exp > 0:
        stat, cells = stat + (pooled_obs - pooled_exp) ** 2 / pooled_exp, cells + 1
    return stat, cells - 1


def test_speculative_sampling_matches_the_target_distribution(tmp_path):
    model_dir = str(build_hf_model(tmp_path / "vocab8", "qwen3", seed=5, vocab_size=VOCAB))
    llm = LLM(model_dir, num_kv_blocks=512, block_size=4, max_num_seqs=256,
              speculative="ngram:k=2", seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    counts = Counter((o.token_ids[1], o.token_ids[2]) for o in outs)
    stat, df = chi_square(counts, exact_joint_of_tokens_2_and_3(model_dir), NUM_SAMPLES)
    assert stat < chi_square_critical(df), f"chi-square {stat:.1f} with {df} df"
    stats = llm.engine.spec_decode_stats()
    assert stats.num_verifications >= NUM_SAMPLES * 0.9
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_pool_clean(llm.engine.block_pool)


def test_the_check_rejects_a_wrong_distribution(tmp_path):
    """The same statistic on plain decoding's samples but against a slightly different
    temperature fails: the test has the power to see a mismatch."""
    model_dir = str(build_hf_model(tmp_path / "vocab8", "qwen3", seed=5, vocab_size=VOCAB))
    llm = LLM(model_dir, num_kv_blocks=512, block_size=4, max_num_seqs=256, seed=1)
    params = SamplingParams(temperature=1.3, max_tokens=3, ignore_eos=True)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params)
    counts = Counter((o.token_ids[1], o.token_ids[2]) for o in outs)
    stat, df = chi_square(counts, exact_joint_of_tokens_2_and_3(model_dir), NUM_SAMPLES)
    assert stat > chi_square_critical(df), f"chi-square {stat:.1f} with {df} df"
