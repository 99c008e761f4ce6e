"""Tests of the sampler on crafted logits: greedy, seeded reproducibility, top-k/top-p filters,
min_tokens bans and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from pdcluster.engine.core.request import Request
from pdcluster.engine.core.sampling_params import SamplingParams
from pdcluster.engine.sample.sampler import Sampler

VOCAB = 16
EOS = 2
CPU = torch.device("cpu")


def make_request(request_id: str = "r", **params) -> Request:
    return Request(request_id, [5, 6, 7], SamplingParams(**params), block_size=4,
                   eos_token_ids=(EOS,))


def random_logits(rows: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * scale


def crafted(probs: list[float]) -> torch.Tensor:
    """Logits of one row whose softmax is `probs` (padded with near-zero mass)."""
    row = torch.full((VOCAB,), -30.0)
    row[: len(probs)] = torch.tensor([math.log(p) for p in probs])
    return row


def draw(sampler: Sampler, row: torch.Tensor, req: Request, n: int) -> list[int]:
    """n draws for one request; the token is appended, as the scheduler would."""
    tokens = []
    for _ in range(n):
        token = sampler.sample(row.clone()[None], [req])[0].token_id
        req.append_output_token(token)
        tokens.append(token)
    return tokens


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    reqs = [make_request(f"r{i}", temperature=0.0) for i in range(8)]
    tokens = [t.token_id for t in Sampler(CPU).sample(logits.clone(), reqs)]
    assert tokens == logits.argmax(dim=-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    row = random_logits(1, seed=1, scale=0.3)[0]  # flat: draws vary a lot
    alone = draw(Sampler(CPU, seed=0), row, make_request("s", seed=42), 30)
    batched_sampler = Sampler(CPU, seed=99)  # a different engine seed must not matter
    seeded = make_request("s", seed=42)
    others = [make_request("u1"), make_request("u2", seed=7)]
    batch = [others[0], seeded, others[1]]
    in_batch = []
    for _ in range(30):
        logits = torch.cat([random_logits(1, seed=len(in_batch) + 5), row[None],
                            random_logits(1, seed=3)])
        token = batched_sampler.sample(logits, batch)[1].token_id
        seeded.append_output_token(token)
        in_batch.append(token)
    assert in_batch == alone
    other_seed = draw(Sampler(CPU, seed=0), row, make_request("s", seed=43), 30)
    assert other_seed != alone and len(set(alone)) > 3


def test_forget_restarts_a_seeded_stream() -> None:
    sampler = Sampler(CPU)
    row = random_logits(1, seed=1, scale=0.3)[0]
    first = draw(sampler, row, make_request("s", seed=5), 10)
    assert draw(sampler, row, make_request("s", seed=5), 10) != first  # stream continued
    sampler.forget("s")
    assert draw(sampler, row, make_request("s", seed=5), 10) == first


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = random_logits(6, seed=2, scale=0.5)
    argmax = logits.argmax(dim=-1).tolist()
    sampler = Sampler(CPU)
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=5.0)):
        reqs = [make_request(f"r{i}", **params) for i in range(6)]
        for _ in range(20):
            assert [t.token_id for t in sampler.sample(logits.clone(), reqs)] == argmax, params


@pytest.mark.parametrize("params, allowed", [
    (dict(top_k=3), {0, 1, 2}),
    # Mass before each token: 0, .4, .7, .9 -> with top_p .6 only tokens 0 and 1 remain.
    (dict(top_p=0.6), {0, 1}),
    (dict(top_k=3, top_p=0.6), {0, 1}),
    (dict(top_k=2, temperature=10.0), {0, 1}),  # a high temperature flattens, filters still hold
])
def test_filters_never_sample_a_filtered_token(params, allowed) -> None:
    row = crafted([0.4, 0.3, 0.2, 0.1])
    tokens = draw(Sampler(CPU, seed=3), row, make_request(max_tokens=500, **params), 400)
    assert set(tokens) == allowed  # never outside, and every allowed token is reachable


def test_unfiltered_sampling_reaches_the_tail() -> None:
    row = crafted([0.4, 0.3, 0.2, 0.1])
    tokens = draw(Sampler(CPU, seed=3), row, make_request(max_tokens=500), 400)
    assert {0, 1, 2, 3} <= set(tokens)


@pytest.mark.parametrize("temperature, low, high", [(0.1, 0.9, 1.0), (1.0, 0.3, 0.5),
                                                    (10.0, 0.0, 0.3)])
def test_temperature_sharpens_or_flattens(temperature, low, high) -> None:
    row = crafted([0.4, 0.3, 0.2, 0.1])
    req = make_request(temperature=temperature, max_tokens=500)
    tokens = draw(Sampler(CPU, seed=4), row, req, 400)
    assert low <= tokens.count(0) / 400 <= high


def test_min_tokens_bans_eos_and_stop_tokens() -> None:
    row = torch.zeros(VOCAB)
    row[EOS], row[9], row[4] = 5.0, 4.0, 3.0  # EOS best, then a stop token, then 4
    sampler = Sampler(CPU)
    req = make_request(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    assert draw(sampler, row, req, 3) == [4, 4, EOS]
    no_eos_ban = make_request(temperature=0.0, min_tokens=2, stop_token_ids=[9],
                              ignore_eos=True)
    assert draw(sampler, row, no_eos_ban, 1) == [EOS]  # EOS ends nothing, so it is not banned
    sampled = make_request(min_tokens=5, stop_token_ids=[9], max_tokens=50)
    assert not {EOS, 9} & set(draw(sampler, row, sampled, 5))


def test_chosen_logprob_is_log_softmax_of_the_raw_logits() -> None:
    logits = random_logits(3, seed=4)
    reqs = [make_request("g", temperature=0.0, logprobs=0),
            make_request("t", temperature=3.0, top_k=4, logprobs=0),
            make_request("none", temperature=0.0)]
    out = Sampler(CPU).sample(logits.clone(), reqs)
    expected = torch.log_softmax(logits, dim=-1)
    for row in range(2):
        assert out[row].logprob == pytest.approx(float(expected[row, out[row].token_id]))
        assert out[row].top_logprobs is None
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_top_logprobs_are_the_k_best_in_order() -> None:
    logits = random_logits(2, seed=5)
    reqs = [make_request("a", temperature=0.0, logprobs=5),
            make_request("b", temperature=1.0, logprobs=1)]
    out = Sampler(CPU).sample(logits.clone(), reqs)
    expected = torch.log_softmax(logits, dim=-1)
    for row, k in ((0, 5), (1, 1)):
        top = out[row].top_logprobs
        assert len(top) == k
        assert [t for t, _ in top] == expected[row].argsort(descending=True)[:k].tolist()
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(expected[row].sort(descending=True).values[:k].tolist())
    assert out[0].top_logprobs[0][0] == out[0].token_id


def test_a_nan_distribution_fails_its_row_and_no_op_asserts_on_it(monkeypatch) -> None:
    """On CUDA, multinomial over NaN probabilities is a device-side assert that poisons the
    whole process (seen on an H100): draws take none, the row fails, the others draw."""
    from pdcluster.engine.core.outputs import RequestFailure
    from tests.helpers import count_calls

    calls = count_calls(monkeypatch, torch, "multinomial")
    bad = make_request("bad", temperature=0.5, seed=1)
    object.__setattr__(bad.params, "temperature", float("nan"))
    good = make_request("good", temperature=0.7, seed=2)
    out = Sampler(CPU).sample(random_logits(2, seed=3), [bad, good])
    assert isinstance(out[0], RequestFailure)
    assert not isinstance(out[1], RequestFailure)
    assert not calls
    alone = Sampler(CPU).sample(random_logits(2, seed=3)[1:],
                                [make_request("good", temperature=0.7, seed=2)])
    assert alone[0].token_id == out[1].token_id  # the bad row changed nothing for it


def test_a_logit_bias_id_past_the_vocabulary_fails_before_indexing(monkeypatch) -> None:
    """An out-of-range index in index_put_ is a device-side assert on CUDA."""
    from pdcluster.engine.core.outputs import RequestFailure
    from tests.helpers import count_calls

    puts = count_calls(monkeypatch, torch.Tensor, "index_put_")
    bad = make_request("bad", temperature=0.0)
    object.__setattr__(bad.params, "logit_bias", {VOCAB + 3: 5.0})
    good = make_request("good", temperature=0.0, logit_bias={1: 100.0})
    out = Sampler(CPU).sample(random_logits(2, seed=4), [bad, good])
    assert isinstance(out[0], RequestFailure) and out[1].token_id == 1
    for args in puts:
        assert int(args[1][1].max()) < VOCAB
