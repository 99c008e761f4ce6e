"""Requests that share a prefix nobody has cached yet, admitted in the same step (W4 of the peer
comparison): the prefix is computed once. Blocks are hashed when they are allocated, so the
second request's prefix hit names blocks the first one fills in the same forward pass, and each
layer writes every token's keys before any chunk attends."""

from __future__ import annotations

from pdcluster.engine import LLMEngine, SamplingParams
from tests.helpers import assert_pool_clean
from tests.models import random_prompts


def test_a_shared_uncached_prefix_is_computed_once_per_step(model_dirs, hf_reference) -> None:
    model = model_dirs["llama-gqa"]
    engine = LLMEngine.from_model(model, num_kv_blocks=128, block_size=4,
                                  max_num_batched_tokens=64)
    prefix = random_prompts(1, 24, 24, seed=11)[0]
    tails = random_prompts(4, 8, 8, seed=12)
    prompts = [prefix + tail for tail in tails]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    chunks: list[tuple[str, int, int]] = []
    execute = engine.runner.execute

    def spy(out, ahead=None):
        chunks.extend((it.request.request_id, it.start, it.num_tokens) for it in out.scheduled
                      if it.num_tokens > 1)
        return execute(out, ahead)

    engine.runner.execute = spy
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.token_ids
    # step 1: r0's 32 tokens and, in the same step, r1..r3 from the prefix r0 is computing
    assert chunks[:4] == [("r0", 0, 32), ("r1", 24, 8), ("r2", 24, 8), ("r3", 24, 8)]
    assert sum(n for *_, n in chunks) == len(prefix) + sum(map(len, tails))
    for i, prompt in enumerate(prompts):
        assert outputs[f"r{i}"] == hf_reference(model, prompt, 6)
    assert_pool_clean(engine.block_pool)
