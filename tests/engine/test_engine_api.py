"""The public engine API on a tiny random model: streaming steps, `LLM.generate` inputs and
ordering, stop strings, aborts, validation, seeded sampling, bfloat16 and prefix-hit reporting.
(Token exactness against transformers is test_hf_parity's job.)"""

from __future__ import annotations

import pytest
import torch

from pdcluster.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["llama-gqa"]


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, num_kv_blocks=64, block_size=4)


@pytest.fixture
def engine(model_dir) -> LLMEngine:
    return LLMEngine.from_model(model_dir, num_kv_blocks=8, block_size=4, max_model_len=64)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting
    assert not engine.scheduler.running and not engine.kv_manager.req_blocks
    assert_pool_clean(engine.block_pool)


def test_step_streams_one_token_per_decoding_request(model_dir) -> None:
    engine = LLMEngine.from_model(model_dir, num_kv_blocks=32, block_size=4)
    max_tokens = {"a": 3, "b": 6, "c": 1}
    prompts = random_prompts(3, 5, 12, seed=1)
    for (rid, n), prompt in zip(max_tokens.items(), prompts, strict=True):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=n, **GREEDY))
    streamed: dict[str, list[int]] = {rid: [] for rid in max_tokens}
    num_steps = 0
    while engine.has_unfinished_requests():
        active = set(engine.scheduler.requests)
        outs = engine.step()
        num_steps += 1
        assert sorted(o.request_id for o in outs) == sorted(active)
        for out in outs:
            assert len(out.new_token_ids) == 1
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids == streamed[out.request_id]
            done = len(out.token_ids) == max_tokens[out.request_id]
            assert out.finished == done
            assert out.finish_reason == ("length" if done else None)
            if done:
                assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert num_steps == 6 and engine.step() == []
    assert_idle(engine)


def test_detokenize_off_gives_the_same_tokens_and_no_text(llm) -> None:
    prompt = random_prompts(1, 6, 6, seed=5)[0]
    on, off = llm.generate([prompt, prompt], [SamplingParams(max_tokens=6, **GREEDY),
                                              SamplingParams(max_tokens=6, detokenize=False,
                                                             **GREEDY)])
    assert off.token_ids == on.token_ids and on.text and off.text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_chunked_prefill_streams_nothing_until_the_prompt_is_done(model_dir) -> None:
    engine = LLMEngine.from_model(model_dir, num_kv_blocks=16, block_size=4,
                                  max_num_batched_tokens=8)
    engine.add_request("long", random_prompts(1, 20, 20, seed=2)[0],
                       SamplingParams(max_tokens=2, **GREEDY))
    assert [engine.step(), engine.step()] == [[], []]  # 16 of 20 prompt tokens computed
    (out,) = engine.step()
    assert len(out.token_ids) == 1 and not out.finished
    assert engine.step()[0].finished
    assert_idle(engine)


def test_generate_accepts_every_prompt_form_and_keeps_order(llm) -> None:
    tok = llm.engine.tokenizer
    params = SamplingParams(max_tokens=5, **GREEDY)
    (from_text,) = llm.generate("Hello world", params)
    assert from_text.prompt_token_ids == tok("Hello world").input_ids
    (from_ids,) = llm.generate([1, 100, 200], params)
    assert from_ids.prompt_token_ids == [1, 100, 200]
    # The first prompt runs longest, so it finishes last but must still come back first.
    mixed = llm.generate(["Hello world", [1, 100, 200]],
                         [SamplingParams(max_tokens=8, **GREEDY), params])
    assert [o.prompt_token_ids for o in mixed] == [from_text.prompt_token_ids, [1, 100, 200]]
    assert [len(o.token_ids) for o in mixed] == [8, 5]
    assert mixed[0].token_ids[:5] == from_text.token_ids
    assert mixed[1].token_ids == from_ids.token_ids
    for out in (from_text, from_ids, *mixed):
        assert out.finished and out.finish_reason == "length"
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [params])
    assert_idle(llm.engine)


def pick_stop_string(tok, tokens: list[int]) -> tuple[str, int]:
    """A stop string that first appears in the text of token k >= 4: (string, k)."""
    for k in range(4, len(tokens)):
        before = tok.decode(tokens[:k], skip_special_tokens=True)
        piece = tok.decode(tokens[: k + 1], skip_special_tokens=True)[len(before):].strip()
        if len(piece) >= 2 and piece[:2] not in before:
            return piece[:2], k
    raise AssertionError("no usable stop string in the greedy text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_generation_and_cuts_text(llm, include) -> None:
    tok, prompt = llm.engine.tokenizer, random_prompts(1, 8, 8, seed=3)[0]
    (free,) = llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))
    stop, k = pick_stop_string(tok, free.token_ids)
    text = tok.decode(free.token_ids[: k + 1], skip_special_tokens=True)
    cut = text.index(stop) + (len(stop) if include else 0)
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=24, stop=stop,
                                                 include_stop_str_in_output=include, **GREEDY))
    assert out.token_ids == free.token_ids[: k + 1]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    assert_idle(llm.engine)


def test_stop_string_in_the_last_allowed_token_still_stops(llm) -> None:
    tok, prompt = llm.engine.tokenizer, random_prompts(1, 8, 8, seed=3)[0]
    (free,) = llm.generate(prompt, SamplingParams(max_tokens=24, **GREEDY))
    stop, k = pick_stop_string(tok, free.token_ids)
    text = tok.decode(free.token_ids[: k + 1], skip_special_tokens=True)
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=k + 1, stop=stop, **GREEDY))
    assert out.token_ids == free.token_ids[: k + 1]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[: text.index(stop)], "stop",
                                                              stop)


def test_abort_mid_generation_frees_blocks(engine) -> None:
    prompts = random_prompts(2, 6, 6, seed=4)
    for rid, prompt in zip("ab", prompts, strict=True):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, **GREEDY))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("a") is True
    assert engine.abort_request("a") is False and engine.abort_request("unknown") is False
    pool = engine.block_pool
    assert pool.num_blocks - pool.num_free_blocks == len(engine.kv_manager.block_ids("b"))
    finished = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert all(o.request_id == "b" for o in outs)
        finished += [o for o in outs if o.finished]
    assert len(finished) == 1 and len(finished[0].token_ids) == 8
    engine.add_request("c", prompts[0], SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    assert engine.abort_request("c")
    assert_idle(engine)


def test_load_and_kv_events_are_what_a_node_reads(model_dir) -> None:
    """The engine's small API for the node that serves it: load figures, KV events and the
    cached hashes, without reaching into the scheduler or the block pool."""
    engine = LLMEngine.from_model(model_dir, num_kv_blocks=8, block_size=4, max_model_len=64,
                                  enable_kv_events=True)
    idle = engine.load()
    assert (idle.num_waiting, idle.num_running, idle.num_queued_tokens) == (0, 0, 0)
    assert idle.num_free_blocks == idle.num_blocks == engine.block_pool.num_blocks
    assert not engine.has_runnable_requests()
    prompt = random_prompts(1, 9, 9, seed=5)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=2, **GREEDY))
    waiting = engine.load()
    assert (waiting.num_waiting, waiting.num_queued_tokens) == (1, len(prompt))
    assert engine.has_runnable_requests()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.load().num_queued_tokens == 0
    events = engine.take_kv_events()
    assert events and engine.take_kv_events() == []
    assert len(engine.cached_block_hashes()) == len(prompt) // 4


@pytest.mark.parametrize("prompt, params, num_kv_blocks", [
    ([], {}, 8),
    ([1, 32000], {}, 8),
    ([1, -1], {}, 8),
    ([5] * 60, dict(max_tokens=5), 64),  # 65 tokens > max_model_len 64, though blocks suffice
    ([5] * 20, dict(max_tokens=20), 8),  # 10 blocks > the pool's 8, though 40 tokens <= 64
    ([1, 2.5], {}, 8),
    ([1, 2**70], {}, 8),
    ([1, 2], dict(stop_token_ids=[32000]), 8),
    ([1, 2], dict(logprobs=21), 8),  # past EngineConfig.max_logprobs (20)
], ids=["empty", "past-vocab", "negative-id", "too-long", "more-blocks-than-pool",
        "float-id", "huge-id", "stop-id-past-vocab", "too-many-logprobs"])
def test_bad_requests_raise_and_change_nothing(model_dir, prompt, params, num_kv_blocks) -> None:
    engine = LLMEngine.from_model(model_dir, num_kv_blocks=num_kv_blocks, block_size=4,
                                  max_model_len=64)
    with pytest.raises(ValueError):
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert "bad" not in engine.scheduler.requests
    assert_idle(engine)
    engine.add_request("good", [5] * 10, SamplingParams(max_tokens=4))  # still serves
    assert engine.step()[0].request_id == "good"
    assert engine.abort_request("good")


def test_duplicate_request_id_is_rejected(engine) -> None:
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [4, 5, 6], SamplingParams(max_tokens=2))
    assert list(engine.scheduler.requests) == ["x"] and len(engine.scheduler.waiting) == 1
    assert engine.scheduler.requests["x"].prompt_token_ids == [1, 2, 3]
    assert engine.abort_request("x")
    assert_idle(engine)


def test_generate_rolls_back_a_batch_with_a_bad_prompt(llm) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[1, 2, 3], "Hello", []], SamplingParams(max_tokens=2))
    assert_idle(llm.engine)


@pytest.mark.parametrize("params", [
    dict(max_tokens=0), dict(top_p=0.0), dict(top_p=1.5), dict(temperature=-1.0),
    dict(min_tokens=5, max_tokens=4), dict(top_k=-1), dict(logprobs=-1), dict(stop=[""]),
    dict(stop_token_ids=[-3]), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(temperature=101.0), dict(top_p=float("nan")), dict(seed=2**64), dict(seed=-(2**63) - 1),
    dict(stop=["x"] * 17), dict(stop=["x" * 257]), dict(stop_token_ids=list(range(257))),
    dict(max_tokens=2.5), dict(logprobs=True), dict(top_k=0.5),
])
def test_bad_sampling_params_raise(params) -> None:
    name = next(iter(params))
    with pytest.raises(ValueError, match=name.split("_ids")[0]):
        SamplingParams(**params)


def test_engine_refusals_name_the_field(engine) -> None:
    cases = [([1, 32000], {}, "prompt token ids"), ([1, 2], dict(logprobs=21), "logprobs"),
             ([1, 2], dict(stop_token_ids=[40000]), "stop_token_ids")]
    for prompt, params, field in cases:
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", prompt, SamplingParams(**params))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("x" * 257, [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("bad", [1, 2], SamplingParams(), cache_salt="s" * 1025)
    engine.add_request("edge", [0, 31999], SamplingParams(
        max_tokens=2, logprobs=20, stop_token_ids=[31999], seed=2**64 - 1, temperature=100.0))
    assert engine.abort_request("edge")
    assert_idle(engine)


@pytest.mark.parametrize("options", [
    dict(dtype="int8"), dict(block_size=0), dict(max_num_seqs=0), dict(num_kv_blocks=0),
    dict(device="tpu"), dict(max_model_len=1), dict(hash_algorithm="md5"),
    dict(max_num_batched_tokens=0), dict(kv_cache_memory_gib=0.0), dict(max_logprobs=-1),
    dict(max_pinned_fraction=0.0), dict(max_pinned_fraction=1.5), dict(pin_timeout_s=0.0),
    dict(tensor_parallel_timeout_s=0.0),
])
def test_engine_config_rejects_bad_values(options) -> None:
    with pytest.raises(ValueError):
        EngineConfig(model="unused", **options)


def test_max_model_len_beyond_the_model_is_rejected(model_dir) -> None:
    with pytest.raises(ValueError, match="exceeds the model's limit 2048"):
        LLMEngine.from_model(model_dir, num_kv_blocks=8, max_model_len=4096)


def test_seeded_sampling_is_reproducible_across_instances(llm, model_dir) -> None:
    other = LLM(model_dir, num_kv_blocks=64, block_size=4, seed=1234)
    prompt = random_prompts(1, 10, 10, seed=5)[0]
    seeded = [SamplingParams(temperature=1.5, seed=s, max_tokens=10, ignore_eos=True)
              for s in (7, 8)]
    first = llm.generate([prompt, prompt], seeded)
    second = other.generate([prompt, prompt], seeded[::-1])
    assert first[0].token_ids == second[1].token_ids and first[1].token_ids == second[0].token_ids
    assert first[0].token_ids != first[1].token_ids


def test_bfloat16_runs_on_cpu(model_dir) -> None:
    llm = LLM(model_dir, dtype="bfloat16", device="cpu", num_kv_blocks=16, block_size=4)
    assert llm.engine.kv_cache.tensor.dtype is llm.engine.dtype is torch.bfloat16
    (out,) = llm.generate(random_prompts(1, 9, 9, seed=6)[0],
                          SamplingParams(max_tokens=6, **GREEDY))
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    assert all(0 <= t < 32000 for t in out.token_ids)
    assert_idle(llm.engine)


def test_num_cached_tokens_reports_the_prefix_hit(llm) -> None:
    prompt = random_prompts(1, 41, 41, seed=7)[0]
    params = SamplingParams(max_tokens=2, **GREEDY)
    first, again = llm.generate(prompt, params)[0], llm.generate(prompt, params)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 40)
    assert again.token_ids == first.token_ids
    assert_idle(llm.engine)
