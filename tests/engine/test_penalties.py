"""Penalties and logit_bias through `LLM` on a tiny model that repeats itself: its layers
write nothing back (zero o_proj/down_proj) and its embeddings are tied and small, so the next
token depends on the current one alone and greedy decoding echoes the prompt's last token
forever, with a margin of about one logit. Each penalty must change that output, neutral
values must not; repetition_penalty must match transformers' own; a batch of mixed settings
must give each request its solo tokens; logit_bias +100 must force its token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.models.tiny_model import make_tiny_model
from tests.helpers import assert_pool_clean

N_OUT = 12
PROMPT = [1, 450, 6635, 3290, 373, 278, 1775]  # ends on the token the model then repeats
NEUTRAL = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
PENALTIES = [dict(presence_penalty=2.0), dict(frequency_penalty=0.5),
             dict(repetition_penalty=4.0),
             dict(presence_penalty=1.0, frequency_penalty=0.3, repetition_penalty=1.2)]


def make_repetitive_model(out: Path) -> Path:
    from safetensors.torch import load_file, save_file

    make_tiny_model(out, arch="qwen2", seed=1)  # qwen2: tied embeddings
    weights = load_file(str(out / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    weights["model.embed_tokens.weight"] *= 0.05
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(make_repetitive_model(tmp_path_factory.mktemp("repetitive")))


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_kv_blocks=64, block_size=4)


def greedy(**params) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, **params)


def generate(llm: LLM, *params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([PROMPT] * len(params), list(params))
    assert_pool_clean(llm.engine.block_pool)
    assert not llm.engine.runner.sampler.processors._counts  # forgotten when finished
    return [out.token_ids for out in outs]


def test_the_model_repeats_and_neutral_penalties_keep_it(llm) -> None:
    plain, neutral = generate(llm, greedy(), greedy(**NEUTRAL))
    assert plain == [PROMPT[-1]] * N_OUT
    assert neutral == plain


@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: ",".join(p))
def test_each_penalty_changes_the_repetitive_output(llm, params) -> None:
    (plain,), (penalized,) = generate(llm, greedy()), generate(llm, greedy(**params))
    assert penalized != plain
    if "frequency_penalty" in params:
        return
    # presence / a strong repetition penalty: the repeated token never comes back twice
    assert penalized.count(PROMPT[-1]) <= 1


def test_repetition_penalty_matches_transformers(llm, model_dir) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])
    for penalty in (4.0, 1.3):
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=N_OUT, repetition_penalty=penalty)
        (got,) = generate(llm, greedy(repetition_penalty=penalty))
        assert got == expected[0, len(PROMPT):].tolist(), penalty


def test_a_mixed_batch_gives_every_request_its_solo_tokens(llm) -> None:
    settings = [greedy(), *(greedy(**p) for p in PENALTIES), greedy(logit_bias={42: 1.0})]
    alone = [generate(llm, params)[0] for params in settings]
    assert generate(llm, *settings) == alone


def test_logit_bias_plus_100_makes_every_token_that_one(llm) -> None:
    (forced,) = generate(llm, greedy(logit_bias={777: 100.0}))
    assert forced == [777] * N_OUT
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=N_OUT, ignore_eos=True,
                             logit_bias={777: 100.0})
    assert generate(llm, sampled) == [[777] * N_OUT]


def test_logit_bias_minus_100_bans_the_repeated_token(llm) -> None:
    (banned,) = generate(llm, greedy(logit_bias={PROMPT[-1]: -100.0}))
    assert PROMPT[-1] not in banned


def test_seeded_sampling_with_penalties_is_reproducible(llm) -> None:
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=N_OUT, ignore_eos=True,
                            frequency_penalty=0.4)
    first = generate(llm, params)
    assert generate(llm, params) == first
    assert generate(llm, params, greedy(presence_penalty=1.0))[0] == first[0]


def test_a_logit_bias_id_outside_the_vocabulary_is_refused(llm) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate([PROMPT], greedy(logit_bias={32000: 1.0}))
