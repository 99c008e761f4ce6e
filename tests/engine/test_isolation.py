"""Per-request isolation in the engine step: a fault in one request's sampling, stop check or
output fails that request alone (finish_reason "error"), while the requests sharing its
batch produce exactly the tokens of a solo run (transformers' greedy continuation) and every
block comes back. Faults are injected into each per-request stage, and parameters that slip
past validation (NaN temperature, logprobs beyond the vocabulary, an out-of-vocabulary stop
id) are run for real."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLMEngine, SamplingParams
from pdcluster.engine.core.outputs import RequestOutput
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

N_OUT = 8
GREEDY = SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["llama-gqa"]


@pytest.fixture
def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_model(model_dir, num_kv_blocks=64, block_size=4,
                                enable_prefix_caching=False)


def run(engine: LLMEngine, bad: SamplingParams = GREEDY) -> dict[str, RequestOutput]:
    """"good0", "bad" and "good1" in one batch, to the end; final output per request."""
    prompts = random_prompts(3, 5, 20, seed=90)
    for rid, prompt in zip(("good0", "bad", "good1"), prompts, strict=True):
        engine.add_request(rid, prompt, bad if rid == "bad" else GREEDY)
    final = {}
    for _ in range(4 * N_OUT):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    return final


def assert_isolated(engine: LLMEngine, final: dict, hf_reference, model_dir) -> None:
    prompts = random_prompts(3, 5, 20, seed=90)
    for rid, prompt in (("good0", prompts[0]), ("good1", prompts[2])):
        assert final[rid].finish_reason == "length"
        assert final[rid].token_ids == hf_reference(model_dir, prompt, N_OUT)
    assert final["bad"].finish_reason == "error" and final["bad"].error
    assert not engine.has_unfinished_requests()
    assert not engine.runner.sampler._req_generators
    assert_pool_clean(engine.block_pool)


def fails_for_bad(original):
    """Wrap a per-request stage so that it raises for "bad" once it has 2 tokens."""
    def stage(*args):
        req = next(a for a in args if hasattr(a, "request_id"))
        if req.request_id == "bad" and req.num_output_tokens >= 2:
            raise Injected("injected fault")
        return original(*args)
    return stage


def test_a_request_whose_sampling_raises_fails_alone(engine, model_dir, hf_reference,
                                                     monkeypatch) -> None:
    sampler = engine.runner.sampler
    monkeypatch.setattr(sampler, "_pick", fails_for_bad(sampler._pick))
    final = run(engine)
    assert final["bad"].token_ids and len(final["bad"].token_ids) == 2
    assert final["bad"].error == "sampling failed on the node"
    assert_isolated(engine, final, hf_reference, model_dir)


def test_a_failing_batched_stage_is_redone_row_by_row(engine, model_dir, hf_reference,
                                                      monkeypatch) -> None:
    sampler = engine.runner.sampler
    batched = sampler._batched
    calls = []

    def faulty(logits, requests, launch=None):
        calls.append(len(requests))
        if any(r.request_id == "bad" for r in requests):
            raise Injected("injected fault")
        return batched(logits, requests, launch)

    monkeypatch.setattr(sampler, "_batched", faulty)
    final = run(engine)
    assert calls[:4] == [3, 1, 1, 1]  # the batch, then each row alone
    assert final["bad"].token_ids == []
    assert_isolated(engine, final, hf_reference, model_dir)


def test_a_failing_stop_check_fails_alone(engine, model_dir, hf_reference,
                                          monkeypatch) -> None:
    scheduler = engine.scheduler
    monkeypatch.setattr(scheduler, "_check_stop", fails_for_bad(scheduler._check_stop))
    final = run(engine)
    assert final["bad"].error == "stop checking failed on the node"
    assert_isolated(engine, final, hf_reference, model_dir)


def test_a_failing_detokenisation_fails_alone(engine, model_dir, hf_reference,
                                              monkeypatch) -> None:
    stops = engine._outputs.stops
    monkeypatch.setattr(stops, "decode", fails_for_bad(stops.decode))
    final = run(engine, SamplingParams(max_tokens=N_OUT, temperature=0.0, ignore_eos=True,
                                       stop=["never-seen-stop-string"]))
    assert final["bad"].error == "detokenising its output failed on the node"
    assert len(final["bad"].token_ids) == 2
    assert_isolated(engine, final, hf_reference, model_dir)


@pytest.mark.parametrize("field, value", [
    ("temperature", float("nan")), ("logprobs", 100_000), ("stop_token_ids", (40_000,)),
], ids=["nan-temperature", "huge-logprobs", "out-of-vocab-stop-id"])
def test_bad_parameters_past_validation_fail_alone(engine, model_dir, hf_reference,
                                                   monkeypatch, field, value) -> None:
    """What validation refuses must still not hurt others if it ever slipped through."""
    monkeypatch.setattr("pdcluster.engine.llm_engine.validate_request", lambda *args: None)
    bad = SamplingParams(max_tokens=N_OUT, min_tokens=2, temperature=0.5, ignore_eos=True)
    object.__setattr__(bad, field, value)
    final = run(engine, bad)
    assert final["bad"].token_ids == []
    assert_isolated(engine, final, hf_reference, model_dir)
