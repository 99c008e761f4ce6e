"""Decode look-ahead (engine/runner/lookahead.py): a step of decodes launches the next one before
its tokens reach the host, and the next step takes it.

On CPU the decode graphs' buffers run eagerly (engine/runner/cuda_graphs.py) and a launch runs
at once, so these tests check what look-ahead must never change: the tokens (transformers'
greedy ones; with sampling, penalties, logprobs, stop tokens, an arrival and an abort, exactly
the tokens of the same engine without look-ahead), the blocks (each freed only after the
launched step's writes), and which steps are taken. What it gains needs a GPU:
`pdcluster bench engine --device cuda` reports the decode step with and without it."""

from __future__ import annotations

import pytest

from pdcluster.engine import LLM, SamplingParams, kernels
from pdcluster.engine.core.outputs import SampledToken
from pdcluster.engine.core.scheduler import Scheduler
from pdcluster.engine.runner import lookahead as lookahead_module
from pdcluster.engine.runner.cuda_graphs import DecodeGraphs
from pdcluster.engine.runner.lookahead import DecodeLookahead
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, make_request
from tests.engine.test_scheduler import make_scheduler
from tests.helpers import assert_pool_clean
from tests.models import random_prompts

# ---- the scheduler's side: which step follows, and holding newcomers back ----------------


def _decoding(sched: Scheduler, *reqs) -> None:
    """Admit `reqs` and run their prompts: each is then in decode."""
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, [SampledToken(500) for _ in out.scheduled])


def test_next_decodes_are_each_request_one_position_on_with_its_slot_allocated():
    sched, pool = make_scheduler()
    a = make_request("a", BLOCK_SIZE - 1, max_tokens=8)  # its next position opens a block
    b = make_request("b", 2, max_tokens=8)
    _decoding(sched, a, b)
    out = sched.schedule()
    following = sched.next_decodes(out)
    assert following is not None
    assert [(f.request.request_id, f.start, f.num_tokens) for f in following] == \
        [("a", a.num_tokens, 1), ("b", b.num_tokens, 1)]
    assert len(following[0].block_ids) == 2, "the next position's block is allocated now"
    for item in following:
        assert len(item.block_ids) * BLOCK_SIZE > item.start
    sched.update_from_output(out, [SampledToken(501) for _ in out.scheduled])
    again = sched.schedule()
    assert [(i.request.request_id, i.start, i.block_ids) for i in again.scheduled] == \
        [(f.request.request_id, f.start, f.block_ids) for f in following]
    for req in (a, b):
        sched.finish_request(req.request_id, req.status.FINISHED_ABORTED)
    assert_pool_clean(pool)


def test_a_request_its_next_token_ends_is_not_in_the_next_step():
    sched, _ = make_scheduler(max_model_len=64)
    ending = make_request("ending", 3, max_tokens=2)
    going = make_request("going", 3, max_tokens=5)
    _decoding(sched, ending, going)
    following = sched.next_decodes(sched.schedule())
    assert following is not None and [f.request.request_id for f in following] == ["going"]


@pytest.mark.parametrize("blocker", ["waiting", "prefill", "remote_decode", "no_blocks"])
def test_no_next_step_is_told_when_it_cannot_be(blocker):
    from pdcluster.core.kv_transfer import RemoteDecode

    sched, _ = make_scheduler(num_blocks=3 if blocker == "no_blocks" else 32)
    req = make_request("r", BLOCK_SIZE * 3 - 1 if blocker == "no_blocks" else 3, max_tokens=5)
    _decoding(sched, req)
    if blocker == "remote_decode":  # a prefill node's request: a transfer reads its blocks
        req.kv_transfer = RemoteDecode("t1")
    if blocker == "waiting":
        sched.add_request(make_request("new", 3))
    if blocker == "prefill":
        sched.add_request(make_request("long", 40))
        out = sched.schedule()
        assert any(i.num_tokens > 1 for i in out.scheduled)
        assert sched.next_decodes(out) is None
        return
    assert sched.next_decodes(sched.schedule()) is None


def test_while_a_step_is_launched_newcomers_wait_one_step():
    sched, _ = make_scheduler()
    old = make_request("old", 3, max_tokens=8)
    _decoding(sched, old)
    new = make_request("new", 3, max_tokens=8)
    sched.add_request(new)
    held = sched.schedule(only={"old"})
    assert [i.request.request_id for i in held.scheduled] == ["old"]
    sched.update_from_output(held, [SampledToken(501)])
    assert {i.request.request_id for i in sched.schedule().scheduled} == {"old", "new"}


def test_a_launched_step_whose_requests_are_all_gone_holds_nobody_back():
    sched, _ = make_scheduler()
    gone = make_request("gone", 3, max_tokens=8)
    _decoding(sched, gone)
    sched.finish_request("gone", gone.status.FINISHED_ABORTED)
    sched.add_request(make_request("new", 3))
    assert [i.request.request_id for i in sched.schedule(only={"gone"}).scheduled] == ["new"]


# ---- the engine: tokens, blocks, steps taken --------------------------------------------


@pytest.fixture(autouse=True)
def _torch_reference_ops(monkeypatch):
    """The graphs' buffers hold int32 block tables, as the GPU kernels read them; on CPU the
    torch reference ops read those too (the CPU C++ kernels take int64 only)."""
    monkeypatch.setattr(kernels, "ENABLED", False)


def _llm(model: str, overlap: bool = True, max_batch: int = 8) -> LLM:
    llm = LLM(model, device="cpu", dtype="float32", num_kv_blocks=96, block_size=4,
              overlap_decode=overlap)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, max_batch=max_batch,
                                 max_model_len=128)
    return llm


def test_greedy_tokens_with_look_ahead_are_transformers(model_dirs, hf_reference):
    model = model_dirs["llama-gqa"]
    llm = _llm(model)
    prompts = random_prompts(3, 5, 14, seed=41)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 5, 12)]
    for prompt, p, out in zip(prompts, params, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_reference(model, prompt, p.max_tokens)
    ahead = llm.engine.runner.lookahead
    assert ahead.num_taken >= 8 and ahead.num_missed == 0, vars(ahead)
    assert_pool_clean(llm.engine.block_pool)


MIXED_PROMPTS = dict(n=6, min_len=4, max_len=11, seed=42)


def mixed_stop_token(model: str, hf_reference) -> int:
    """A token request r3 of `mixed_run` meets a few tokens in (its greedy 5th)."""
    return hf_reference(model, random_prompts(**MIXED_PROMPTS)[3], 12)[4]


def mixed_run(llm: LLM, stop_token: int) -> tuple[dict, DecodeLookahead]:
    """Sampling, penalties, logprobs, a stop token, an arrival mid-decode and an abort: each
    request's (token ids, finish reason, logprobs), and the runner's look-ahead counts."""
    engine = llm.engine
    prompts = random_prompts(**MIXED_PROMPTS)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                             max_tokens=11),
              SamplingParams(temperature=0.0, stop_token_ids=[stop_token], max_tokens=12),
              SamplingParams(temperature=1.0, seed=3, top_k=20, max_tokens=7),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    for i in range(5):
        engine.add_request(f"r{i}", prompts[i], params[i])
    outputs: dict = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (out.token_ids, out.finish_reason,
                                           out.logprobs or [])
        steps += 1
        if steps == 3:
            engine.add_request("r5", prompts[5], params[5])
        if steps == 6:
            engine.abort_request("r2")
            outputs["r2"] = ([], "aborted", [])
    assert_pool_clean(engine.block_pool)
    return outputs, engine.runner.lookahead


def assert_same_runs(with_it: tuple[dict, DecodeLookahead],
                     without: tuple[dict, DecodeLookahead]) -> None:
    assert with_it[0].keys() == without[0].keys()
    for rid, ran in with_it[0].items():
        other = without[0][rid]
        assert ran[:2] == other[:2], rid
        assert ran[2] == pytest.approx(other[2], abs=1e-4), rid
    assert with_it[0]["r3"][1] == "stop" and with_it[0]["r5"][1] == "length"
    assert without[1].num_launched == 0
    # Every launched step was taken: finishing and aborted requests only dropped rows, and
    # the newcomer waited one step instead of making the launched step useless.
    ahead = with_it[1]
    assert ahead.num_taken >= 5 and ahead.num_missed == 0, vars(ahead)


def test_look_ahead_changes_no_token_of_any_request(model_dirs, hf_reference):
    model = model_dirs["llama-gqa"]
    stop_token = mixed_stop_token(model, hf_reference)
    assert_same_runs(mixed_run(_llm(model, True), stop_token),
                     mixed_run(_llm(model, False), stop_token))


def test_blocks_are_freed_only_after_the_launched_steps_writes(model_dirs, monkeypatch):
    """An abort between steps and a stop token inside one both free a request the launched
    step writes into: each waits for that step's mark first, with the blocks still held."""
    llm = _llm(model_dirs["llama-gqa"])
    engine = llm.engine
    ahead = engine.runner.lookahead
    waits: list[tuple[str, int]] = []

    def wait(mark):
        if mark is ahead._written:
            waits.append((sorted(ahead._writers)[0], engine.block_pool.num_free_blocks))

    monkeypatch.setattr(lookahead_module.DeviceMark, "wait", wait)
    prompts = random_prompts(2, 6, 6, seed=43)
    engine.add_request("aborted", prompts[0], SamplingParams(temperature=0.0, max_tokens=20,
                                                             ignore_eos=True))
    while ahead.launched is None:
        engine.step()
    free_before = engine.block_pool.num_free_blocks
    assert engine.abort_request("aborted")
    assert waits == [("aborted", free_before)]
    assert engine.block_pool.num_free_blocks > free_before
    # The launched step's only request is gone: a newcomer is served, and the launched step
    # is thrown away (its rows are nobody's now).
    new = random_prompts(1, 5, 5, seed=44)[0]
    engine.add_request("after", new, SamplingParams(temperature=0.0, max_tokens=3))
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    assert [out.request_id for out in finished] == ["after"]
    assert ahead.num_missed == 1
    assert_pool_clean(engine.block_pool)


def test_overlap_decode_false_launches_nothing(model_dirs):
    """(The vLLM backend refuses it by name: tests/vllm_backend/test_backend_units.py.)"""
    llm = _llm(model_dirs["llama-gqa"], overlap=False)
    llm.generate(random_prompts(2, 5, 8, seed=44),
                 SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert llm.engine.runner.lookahead.num_launched == 0


def test_a_decode_node_with_look_ahead_takes_in_arrivals_of_remote_kv(model_dirs,
                                                                       hf_reference):
    """A decode node decoding in launched steps while prompts' KV keeps arriving from a
    prefill node (the production connector over the in-process loopback wire): each
    arrival joins a step later, no launched step is thrown away, every block is freed."""
    from tests.transfer.disagg import drive, idle, make_engine, submit
    from tests.transfer.loopback import LoopbackFabric

    model = model_dirs["llama-gqa"]
    fabric = LoopbackFabric()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    prefill = make_engine(model, p_transport, device="cpu", dtype="float32")
    decode = make_engine(model, d_transport, device="cpu", dtype="float32")
    decode.runner.graphs = DecodeGraphs(decode.runner.model, decode.runner.kv_cache,
                                        max_batch=8, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(5, 4, 30, seed=45)
    runs = [submit(prefill, decode, prompts[0], params, p_transport.reply_address)]
    steps = iter(range(1000))

    def arrive() -> None:  # one more request every third step while the others decode
        step = next(steps)
        if step % 3 == 2 and len(runs) < len(prompts):
            runs.append(submit(prefill, decode, prompts[len(runs)], params,
                               p_transport.reply_address))

    final = drive([prefill, decode], lambda: len(runs) == len(prompts) and idle(prefill)
                  and idle(decode), on_step=arrive)
    for prompt, run in zip(prompts, runs, strict=True):
        assert final[run.decode_id].token_ids == hf_reference(model, prompt, 10)
    assert decode.connector.worker.stats.recvs_ok == len(prompts)
    ahead = decode.runner.lookahead
    assert ahead.num_taken >= 5 and ahead.num_missed == 0, vars(ahead)
    for engine in (prefill, decode):
        assert_pool_clean(engine.block_pool)
        engine.close()
