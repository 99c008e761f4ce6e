"""The sampler's batched logits processors on crafted logits: logit_bias, presence /
frequency / repetition penalties (their exact arithmetic), neutral values leaving a row
bit-identical, a mixed batch equal to each row alone, and counts kept incrementally from the
request's output (tokens appended elsewhere count too)."""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine.core.request import Request
from pdcluster.engine.core.sampling_params import SamplingParams
from pdcluster.engine.sample.logits_processors import LogitsProcessors
from pdcluster.engine.sample.sampler import Sampler

VOCAB = 16
CPU = torch.device("cpu")
PROMPT = [5, 6, 7]


def make_request(request_id: str = "r", output: tuple[int, ...] = (), **params) -> Request:
    req = Request(request_id, PROMPT, SamplingParams(**params), block_size=4,
                  eos_token_ids=(2,))
    for token in output:
        req.append_output_token(token)
    return req


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def processed(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    out = logits.clone()
    LogitsProcessors(CPU).apply(out, requests)
    return out


def test_logit_bias_adds_to_the_named_tokens() -> None:
    logits = random_logits(1)
    out = processed(logits, [make_request(logit_bias={3: 100.0, 4: -100, 15: 0.5})])
    expected = logits.clone()
    expected[0, 3] += 100.0
    expected[0, 4] -= 100.0
    expected[0, 15] += 0.5
    assert torch.equal(out, expected)


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = random_logits(1)
    req = make_request(output=(9, 9, 9, 11), presence_penalty=0.5, frequency_penalty=0.25)
    out = processed(logits, [req])
    expected = logits.clone()
    expected[0, 9] -= 0.5 + 3 * 0.25
    expected[0, 11] -= 0.5 + 0.25
    assert torch.allclose(out, expected)  # prompt tokens 5, 6, 7 untouched
    assert torch.equal(out[0, PROMPT], logits[0, PROMPT])


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6], logits[0, 9], logits[0, 12] = 3.0, -2.0, 1.5, 4.0
    out = processed(logits, [make_request(output=(9,), repetition_penalty=2.0)])
    assert out[0, 5] == 1.5 and out[0, 6] == -4.0 and out[0, 9] == 0.75  # prompt + output
    assert out[0, 12] == 4.0  # never seen


def test_neutral_values_leave_a_row_bit_identical() -> None:
    logits = random_logits(2, seed=1)
    neutral = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    penalized = make_request("p", output=(1, 1, 3), presence_penalty=1.0,
                             frequency_penalty=-0.5, repetition_penalty=1.7,
                             logit_bias={3: 2.0})
    out = processed(logits, [make_request("n", output=(1, 1, 3), **neutral,
                                          logit_bias={3: 0.0}), penalized])
    assert torch.equal(out[0], logits[0])
    assert not torch.equal(out[1], logits[1])


def test_a_mixed_batch_gives_each_row_what_it_gets_alone() -> None:
    settings = [dict(presence_penalty=1.0), dict(frequency_penalty=0.7),
                dict(repetition_penalty=1.5), dict(), dict(logit_bias={4: 3.0}),
                dict(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8)]
    outputs = [(1, 2, 2), (3, 3, 3, 4), (5, 8), (9,), (), (4, 4, 10)]
    logits = random_logits(len(settings), seed=2)

    def requests():
        return [make_request(f"r{i}", out, **kw)
                for i, (out, kw) in enumerate(zip(outputs, settings, strict=True))]

    batched = processed(logits, requests())
    for row, req in enumerate(requests()):
        assert torch.equal(batched[row], processed(logits[row:row + 1], [req])[0]), row


def test_counts_follow_the_output_incrementally() -> None:
    processors = LogitsProcessors(CPU)
    req = make_request(frequency_penalty=1.0)
    logits = torch.zeros(1, VOCAB)
    for step, token in enumerate((3, 3, 8)):
        out = logits.clone()
        processors.apply(out, [req])
        assert -out[0].sum() == step  # one unit per output token counted so far
        req.append_output_token(token)
    req.append_output_token(3)  # two tokens arrive between two steps
    out = logits.clone()
    processors.apply(out, [req])
    assert out[0, 3] == -3.0 and out[0, 8] == -1.0
    processors.forget(req.request_id)
    assert not processors._counts and not processors._bias


def test_greedy_picks_the_biased_token_and_logprobs_stay_the_models() -> None:
    logits = random_logits(1, seed=4)
    req = make_request(temperature=0.0, logprobs=1, logit_bias={13: 100.0})
    token = Sampler(CPU).sample(logits.clone(), [req])[0]
    assert token.token_id == 13
    assert token.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[13]))


def test_a_seeded_sampled_row_is_unchanged_by_its_neighbours_settings() -> None:
    """Penalties and bias on other rows must not move a seeded row's draws."""
    def draws(neighbour: dict) -> list[int]:
        sampler = Sampler(CPU)
        seeded = make_request("s", seed=7, temperature=1.0)
        other = make_request("o", **neighbour)
        tokens = []
        for step in range(20):
            logits = random_logits(2, seed=step)
            token = sampler.sample(logits, [other, seeded])[1].token_id
            seeded.append_output_token(token)
            tokens.append(token)
        return tokens

    assert draws({}) == draws(dict(presence_penalty=2.0, logit_bias={1: 50.0}))


@pytest.mark.parametrize("bad, match", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(logit_bias={3: 101.0}), "logit_bias value"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
    (dict(logit_bias={"3": 1.0}), "logit_bias token id"),
    (dict(logit_bias={True: 1.0}), "logit_bias token id"),
    (dict(logit_bias=[(3, 1.0)]), "logit_bias must be a map"),
    (dict(logit_bias=dict.fromkeys(range(1025), 1.0)), "at most 1024"),
], ids=lambda v: str(v)[:40])
def test_out_of_range_values_are_refused(bad, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)
