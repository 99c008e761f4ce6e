"""Speculative decoding's parts without a model: the config's text form, n-gram lookup,
greedy acceptance, statistics, the back-off, and rejection sampling's output distribution
(a statistical check with a fixed seed and a stated tolerance)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.sample.rejection import accept_greedy, rejection_sample
from pdcluster.engine.spec_decode.config import SpeculativeConfig
from pdcluster.engine.spec_decode.ngram import NgramProposer
from pdcluster.engine.spec_decode.stats import SpecDecodeStats


def test_parse_forms():
    assert SpeculativeConfig.parse("ngram:k=4") == SpeculativeConfig("ngram", 4)
    cfg = SpeculativeConfig.parse("draft:/m/small,k=3")
    assert (cfg.method, cfg.draft_model, cfg.num_speculative_tokens) == ("draft", "/m/small", 3)
    cfg = SpeculativeConfig.parse("ngram:k=5,min_n=2,max_n=4")
    assert (cfg.ngram_min, cfg.ngram_max) == (2, 4)
    assert SpeculativeConfig.coerce("") is None and SpeculativeConfig.coerce(None) is None


@pytest.mark.parametrize("text", ["beam:k=2", "ngram:k=0", "ngram:k=x", "ngram:q=1", "draft:k=4",
                                  "ngram:min_n=3,max_n=2", "ngram:/path,k=2"])
def test_parse_refuses(text):
    with pytest.raises(ValueError):
        SpeculativeConfig.parse(text)


def test_engine_config_takes_the_text_form():
    from pdcluster.engine.config import EngineConfig

    assert EngineConfig("m", speculative="ngram:k=2").speculative == SpeculativeConfig("ngram", 2)
    with pytest.raises(ValueError):
        EngineConfig("m", speculative="ngram:k=99")


def test_ngram_lookup_prefers_longest_and_latest():
    ngram = NgramProposer(1, 3)
    # "7 8" occurs twice before the end; the latest occurrence's continuation wins.
    assert ngram.lookup([7, 8, 1, 2, 7, 8, 3, 4, 5, 7, 8], 3) == [3, 4, 5]
    # The 3-gram "1 2 3" beats the later 1-gram "3".
    assert ngram.lookup([1, 2, 3, 9, 9, 3, 5, 1, 2, 3], 2) == [9, 9]
    assert ngram.lookup([1, 2, 3, 4], 4) == []
    assert ngram.lookup([5, 6, 5], 4) == [6, 5]  # a continuation may be shorter than k
    assert NgramProposer(2, 3).lookup([1, 2, 3, 9, 3], 2) == []  # 1-grams are off


def test_accept_greedy():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]
    assert accept_greedy([4, 5, 6], [1, 5, 6, 7]) == [1]


def test_stats_per_position():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(2, 2)
    stats.record(3, 0)
    assert stats.num_draft_tokens == 9 and stats.num_accepted_tokens == 4
    assert stats.num_emitted_tokens == 7
    assert stats.position_rates() == [2 / 3, 2 / 3, 0.0, 0.0]
    assert stats.as_dict()["spec_acceptance_rate"] == round(4 / 9, 4)


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.parametrize("draft_probs", [False, True])
def test_rejection_sampling_matches_the_target(draft_probs):
    """Emitted tokens follow the target whatever the proposal: the first emitted token is
    distributed as p_0, and the second — given the first was the proposed one — as p_1.
    Proposals are a fixed point mass, or drawn from a draft distribution q. 30,000 draws over
    6 tokens: the empirical total-variation distance is about 0.006 (first) and 0.012
    (second, fewer draws) in expectation; the bound 0.035 fails a broken rule (accepting
    always, or redrawing from p instead of the residual, moves it by more than 0.1)."""
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, 6, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, 6, generator=gen), dim=-1) if draft_probs else None
    first, second = torch.zeros(6), torch.zeros(6)
    for _ in range(30_000):
        drafts = [2, 4] if q is None else torch.multinomial(q, 1, generator=gen)[:, 0].tolist()
        tokens = rejection_sample(probs, drafts, q, gen)
        first[tokens[0]] += 1
        if tokens[0] == drafts[0] and (q is None or drafts[0] == 2):
            second[tokens[1]] += 1
    assert _tv(first / first.sum(), probs[0]) < 0.035
    assert _tv(second / second.sum(), probs[1]) < 0.035
