"""Scheduler scenarios, torch-free: the model is simulated by feeding `update_from_output` one
token for every scheduled item whose chunk samples. Every scenario ends with all requests run
to completion (or aborted) and a leak check of the pool."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.engine.core.block_pool import BlockPool
from pdcluster.engine.core.kv_cache_manager import KVCacheManager
from pdcluster.engine.core.outputs import SampledToken
from pdcluster.engine.core.request import Request, RequestStatus
from pdcluster.engine.core.scheduler import Scheduler, SchedulerConfig
from tests.engine.test_kv_cache_manager import BLOCK_SIZE, EOS, make_request
from tests.helpers import assert_pool_clean

Model = Callable[[Request], int]


def counting_model(req: Request) -> int:
    """A fake model: the n-th generated token of every request is 500 + n (never EOS)."""
    return 500 + req.num_output_tokens


def scripted(*tokens: int) -> Model:
    return lambda req: tokens[req.num_output_tokens]


def make_scheduler(num_blocks: int = 32, budget: int = 64, max_num_seqs: int = 8,
                   max_model_len: int = 256, events: bool = False
                   ) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_events=events)
    config = SchedulerConfig(budget, max_num_seqs, max_model_len)
    return Scheduler(config, KVCacheManager(pool)), pool


@dataclass(frozen=True)
class Chunk:
    """A scheduled item as the model saw it (`samples` changes once the step is applied)."""

    request_id: str
    start: int
    num_tokens: int
    samples: bool
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Step:
    chunks: list[Chunk]
    preempted: list[str]

    @property
    def ids(self) -> list[str]:
        return [c.request_id for c in self.chunks]

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


def step(sched: Scheduler, model: Model = counting_model) -> Step:
    out = sched.schedule()
    chunks = [Chunk(i.request.request_id, i.start, i.num_tokens, i.samples, tuple(i.block_ids))
              for i in out.scheduled]
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert len(sched.running) <= sched.config.max_num_seqs
    ids = [c.request_id for c in chunks]
    assert len(ids) == len(set(ids)), f"a request scheduled twice: {ids}"
    for c in chunks:
        assert c.num_tokens >= 1 and len(c.block_ids) * BLOCK_SIZE >= c.start + c.num_tokens
    sampled = [SampledToken(model(item.request)) if item.samples else None
               for item in out.scheduled]
    sched.update_from_output(out, sampled)
    return Step(chunks, list(out.preempted))


def run_all(sched: Scheduler, model: Model = counting_model) -> list[Step]:
    steps = []
    while sched.has_unfinished_requests():
        assert len(steps) < 1000, "the scheduler stopped making progress"
        steps.append(step(sched, model))
    return steps


def test_token_budget_respected_and_all_work_done() -> None:
    sched, pool = make_scheduler(budget=7)
    reqs = [make_request(f"r{i}", n, max_tokens=3) for i, n in enumerate([1, 5, 13, 20, 2])]
    for req in reqs:
        sched.add_request(req)
    outs = run_all(sched)
    assert max(out.num_batched_tokens for out in outs) == 7
    # No prefix hits: every prompt token and every generated token but the last is computed.
    assert sum(out.num_batched_tokens for out in outs) == sum(r.num_prompt_tokens + 2 for r in reqs)
    assert all(r.output_token_ids == [500, 501, 502] for r in reqs)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs)
    assert_pool_clean(pool)


def test_chunked_prefill_splits_a_long_prompt_mid_block() -> None:
    sched, pool = make_scheduler(budget=3)
    req = make_request("long", 10, max_tokens=2)
    sched.add_request(req)
    chunks = []
    for _ in range(4):
        (c,) = step(sched).chunks
        chunks.append((c.start, c.num_tokens, c.samples, len(c.block_ids)))
    assert chunks == [(0, 3, False, 1), (3, 3, False, 2), (6, 3, False, 3), (9, 1, True, 3)]
    assert req.output_token_ids == [500] and req.num_computed_tokens == 10
    run_all(sched)
    assert_pool_clean(pool)


def test_decodes_are_scheduled_before_prefills() -> None:
    sched, pool = make_scheduler(budget=5)
    late = make_request("decoder", 2, max_tokens=12, arrival_time=10.0)
    early = make_request("prefiller", 30, max_tokens=1, arrival_time=0.0)  # arrived first
    sched.add_request(late)
    sched.add_request(early)
    assert step(sched).ids == ["decoder", "prefiller"]
    while early.is_prefilling:
        out = step(sched)
        # Oldest-first would hand the whole budget to the prefill and starve the decode.
        assert out.ids == ["decoder", "prefiller"]
        assert out.chunks[0].num_tokens == 1 and out.num_batched_tokens in (4, 5)
    run_all(sched)
    assert late.num_output_tokens == 12 and early.num_output_tokens == 1
    assert_pool_clean(pool)


def test_fcfs_a_request_that_does_not_fit_blocks_later_ones() -> None:
    sched, pool = make_scheduler(num_blocks=6)
    first = make_request("first", 12, max_tokens=1)  # 3 blocks
    big = make_request("big", 16, max_tokens=1)  # 4 blocks: does not fit next to `first`
    small = make_request("small", 2, max_tokens=1)  # would fit, but must wait its turn
    for req in (first, big, small):
        sched.add_request(req)
    assert step(sched).ids == ["first"]
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    assert step(sched).ids == ["big", "small"]
    run_all(sched)
    assert_pool_clean(pool)


def test_max_num_seqs_caps_running_requests() -> None:
    sched, pool = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", 3, max_tokens=2) for i in range(5)]
    for req in reqs:
        sched.add_request(req)
    admitted = []
    while sched.has_unfinished_requests():
        out = step(sched)
        admitted += [i for i in out.ids if i not in admitted]
        assert len(out.chunks) <= 2
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]
    assert_pool_clean(pool)


def test_preemption_victim_is_latest_arrival_and_requeued_at_front() -> None:
    sched, pool = make_scheduler(num_blocks=5)
    grower = make_request("grower", 7, max_tokens=6)  # 2 blocks; needs a 3rd at position 8
    middle = make_request("middle", 1, max_tokens=3)
    latest = make_request("latest", 5, max_tokens=4)  # 2 blocks
    for req in (grower, middle, latest):
        sched.add_request(req)
    step(sched)  # all 5 blocks now in use
    queued = make_request("queued", 2, max_tokens=1)
    sched.add_request(queued)
    out = step(sched)
    assert out.ids == ["grower", "middle", "latest"] and not out.preempted
    out = step(sched)  # grower needs a block: the latest arrival gives its up, not `middle`
    assert out.preempted == ["latest"] and latest.status is RequestStatus.PREEMPTED
    assert out.ids == ["grower", "middle"] and middle.is_finished
    assert pool.num_free_blocks == 2  # latest's cached first block and middle's
    assert [r.request_id for r in sched.waiting] == ["latest", "queued"]
    assert latest.num_computed_tokens == 0 and latest.num_preemptions == 1
    assert latest.output_token_ids == [500, 501]
    out = step(sched)  # recomputed ahead of `queued`, from its own cached first block
    assert out.ids == ["grower", "latest"] and out.chunks[1].start == 4
    run_all(sched)
    assert latest.output_token_ids == [500, 501, 502, 503] and latest.num_cached_tokens == 0
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (grower, latest, queued))
    assert sched.num_preemptions == 1
    assert_pool_clean(pool)


def test_abort_waiting_running_and_in_flight_requests() -> None:
    sched, pool = make_scheduler(num_blocks=4)
    running = make_request("running", 8, max_tokens=8)
    in_flight = make_request("in_flight", 4, max_tokens=8)
    waiting = make_request("waiting", 8, max_tokens=1)
    for req in (running, in_flight, waiting):
        sched.add_request(req)
    step(sched)
    assert pool.num_free_blocks == 1 and sched.waiting[0] is waiting
    assert sched.finish_request("waiting", RequestStatus.FINISHED_ABORTED) is waiting
    assert sched.finish_request("running", RequestStatus.FINISHED_ABORTED) is running
    assert sched.finish_request("running", RequestStatus.FINISHED_ABORTED) is None  # idempotent
    assert pool.num_free_blocks == 3 and not sched.waiting
    out = sched.schedule()
    sched.finish_request("in_flight", RequestStatus.FINISHED_ABORTED)  # while the step runs
    sched.update_from_output(out, [SampledToken(9)] * len(out.scheduled))
    assert in_flight.output_token_ids == [500]
    assert {r.status for r in (running, in_flight, waiting)} == {RequestStatus.FINISHED_ABORTED}
    assert not sched.has_unfinished_requests() and not sched.running
    assert_pool_clean(pool)


def finish_of(model: Model, max_model_len: int = 256, prompt_len: int = 3,
              **params) -> Request:
    sched, pool = make_scheduler(max_model_len=max_model_len)
    req = make_request("r", prompt_len, **params)
    sched.add_request(req)
    run_all(sched, model)
    assert_pool_clean(pool)
    return req


def test_stop_conditions() -> None:
    stop_token = finish_of(scripted(7, 8, 9, 10), max_tokens=4, stop_token_ids=(9,))
    assert stop_token.output_token_ids == [7, 8, 9]
    assert (stop_token.status, stop_token.stop_reason) == (RequestStatus.FINISHED_STOPPED, 9)
    eos = finish_of(scripted(7, EOS, 9), max_tokens=3)
    assert eos.output_token_ids == [7, EOS] and eos.status is RequestStatus.FINISHED_STOPPED
    assert eos.stop_reason == EOS
    ignored = finish_of(scripted(7, EOS, 9), max_tokens=3, ignore_eos=True)
    assert ignored.output_token_ids == [7, EOS, 9]
    assert ignored.status is RequestStatus.FINISHED_LENGTH and ignored.stop_reason is None
    length = finish_of(counting_model, max_tokens=5)
    assert length.num_output_tokens == 5 and length.status is RequestStatus.FINISHED_LENGTH
    capped = finish_of(counting_model, max_model_len=10, prompt_len=8, max_tokens=5)
    assert capped.num_tokens == 10 and capped.status is RequestStatus.FINISHED_LENGTH


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    eos = finish_of(scripted(EOS, EOS, EOS, EOS), max_tokens=4, min_tokens=3)
    assert eos.output_token_ids == [EOS] * 3 and eos.status is RequestStatus.FINISHED_STOPPED
    stop = finish_of(scripted(9, 9, 5, 9, 1, 1), max_tokens=6, min_tokens=3,
                     stop_token_ids=(9,))
    assert stop.output_token_ids == [9, 9, 5, 9] and stop.stop_reason == 9


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    sched, pool = make_scheduler()
    first = make_request("first", 8, max_tokens=1)
    sched.add_request(first)
    run_all(sched)
    same = make_request("same", prompt=first.prompt_token_ids, max_tokens=1)
    longer = make_request("longer", prompt=first.prompt_token_ids + [7], max_tokens=1)
    sched.add_request(same)
    sched.add_request(longer)
    out = step(sched)
    # The hit is capped at whole blocks that leave a token to compute for the logits.
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [
        (4, 4, True), (8, 1, True)]
    assert (same.num_cached_tokens, longer.num_cached_tokens) == (4, 8)
    run_all(sched)
    assert_pool_clean(pool)


def test_blocks_filled_during_decode_become_prefix_hits() -> None:
    sched, pool = make_scheduler()
    first = make_request("first", 2, max_tokens=10)  # 11 computed tokens: 2 full blocks,
    sched.add_request(first)                          # 6 of their 8 tokens generated
    first_blocks = run_all(sched)[-1].chunks[0].block_ids
    follow = make_request("follow", prompt=first.all_token_ids, max_tokens=1)
    sched.add_request(follow)
    out = step(sched)
    assert follow.num_cached_tokens == 8
    assert out.chunks[0].block_ids[:2] == first_blocks[:2]
    run_all(sched)
    assert_pool_clean(pool)


def test_freed_chain_loses_its_tail_before_its_head() -> None:
    sched, pool = make_scheduler(num_blocks=3)
    first = make_request("first", 12, max_tokens=1)  # 3 cached blocks once finished
    sched.add_request(first)
    run_all(sched)
    sched.add_request(make_request("other", 8, max_tokens=1))  # evicts 2 cached blocks
    run_all(sched)
    again = make_request("again", prompt=first.prompt_token_ids, max_tokens=1)
    sched.add_request(again)
    run_all(sched)
    assert again.num_cached_tokens == 4  # block 0 survived; blocks 1 and 2 were evicted
    assert_pool_clean(pool)


def test_cache_salt_isolates_tenants() -> None:
    sched, pool = make_scheduler()
    owner = make_request("owner", 9, max_tokens=1, cache_salt="tenant-a")
    sched.add_request(owner)
    run_all(sched)
    prompt = owner.prompt_token_ids
    others = [make_request("other-tenant", prompt=prompt, max_tokens=1, cache_salt="tenant-b"),
              make_request("no-salt", prompt=prompt, max_tokens=1),
              make_request("same-tenant", prompt=prompt, max_tokens=1, cache_salt="tenant-a")]
    for req in others:
        sched.add_request(req)
    run_all(sched)
    assert [r.num_cached_tokens for r in others] == [0, 0, 8]
    assert others[0].block_hashes[0] != owner.block_hashes[0] != others[1].block_hashes[0]
    assert_pool_clean(pool)
