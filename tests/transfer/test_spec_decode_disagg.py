"""Speculative decoding on a decode node that receives its prompts' KV from a prefill node
(the production connector over the loopback transport): the tokens equal transformers', the
decode node verifies proposals on top of the received blocks, and both nodes (and the draft
model's pool) end with every block free."""

from __future__ import annotations

import pytest

from pdcluster.engine import SamplingParams
from tests.engine.spec_fakes import OracleProposer
from tests.helpers import assert_pool_clean
from tests.models import random_prompts
from tests.transfer.disagg import drive, idle, make_engine, submit
from tests.transfer.loopback import LoopbackFabric

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("proposer", ["oracle", "draft"])
def test_decode_node_speculates_on_received_kv(proposer, model_dirs, hf_reference):
    model_dir = model_dirs["llama-gqa"]
    fabric = LoopbackFabric()
    p_transport, d_transport = fabric.transport(), fabric.transport()
    spec = "ngram:k=3" if proposer == "oracle" else f"draft:{model_dir},k=3"
    prefill = make_engine(model_dir, p_transport)
    decode = make_engine(model_dir, d_transport, speculative=spec)
    prompts = random_prompts(5, 3, 50, seed=20)
    truth = {tuple(p): hf_reference(model_dir, p, GREEDY.max_tokens) for p in prompts}
    if proposer == "oracle":
        decode.spec_decoder.proposer = OracleProposer(truth, 3, decode.model_config.vocab_size)
    try:
        runs = [submit(prefill, decode, p, GREEDY, p_transport.reply_address) for p in prompts]
        final = drive([prefill, decode], lambda: idle(prefill) and idle(decode))
        for prompt, run in zip(prompts, runs, strict=True):
            assert final[run.decode_id].token_ids == truth[tuple(prompt)]
        assert prefill.connector.worker.stats.sends_ok == len(prompts)
        stats = decode.spec_decode_stats()
        assert stats.num_verifications > 0 and stats.num_accepted_tokens > 0
        assert prefill.spec_decode_stats() is None
        for engine in (prefill, decode):
            assert_pool_clean(engine.block_pool)
        if proposer == "draft":
            assert_pool_clean(decode.spec_decoder.proposer.block_pool)
    finally:
        prefill.close()
        decode.close()
